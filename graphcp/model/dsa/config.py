"""DeepSeek Sparse Attention (DSA) models' settings, read from a Hugging Face config.json.

Two families, read as transformers 5 reads them (a missing key takes the family's
transformers default):

- ``deepseek_v32`` (``DeepseekV32ForCausalLM``, DeepSeek V3.2): the indexer rotates
  the first ``qk_rope_head_dim`` dims of its query and key with half-split RoPE;
- ``glm_moe_dsa`` (``GlmMoeDsaForCausalLM``, the GLM-5 series): the indexer uses
  interleaved RoPE, and a layer may reuse the previous indexer layer's top-k
  (``indexer_types``: ``"full"`` runs the indexer, ``"shared"`` reuses).

Both attend with MLA (multi-head latent attention: ``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim`` + ``qk_rope_head_dim`` per query/key head, ``v_head_dim`` per
value head, interleaved RoPE on the rope part) restricted, for each query, to the
``index_topk`` tokens the indexer selects, and run DeepSeek's MoE (sigmoid router
with ``e_score_correction_bias`` for selection, group-limited top-k, shared experts)
in the layers past ``first_k_dense_replace`` (or as ``mlp_layer_types`` says).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from graphcp.checks import check_bool, check_choice, check_float, check_int
from graphcp.errors import ConfigError
from graphcp.model.moe_config import MoeConfig
from graphcp.model.rope import yarn_mscale

DsaFamily = Literal["deepseek_v32", "glm_moe_dsa"]
DSA_FAMILIES: tuple[str, ...] = ("deepseek_v32", "glm_moe_dsa")
MAX_DIM = 1 << 16
MAX_EXPERTS = 1 << 16
MAX_TOPK = 1 << 24

#: transformers' defaults for the keys read here (DeepseekV32Config / GlmMoeDsaConfig)
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_n_heads=64, index_head_dim=128, index_topk=2048, moe_intermediate_size=2048, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True,
        routed_scaling_factor=2.5, first_k_dense_replace=3,
    ),
    "glm_moe_dsa": dict(
        q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
        index_n_heads=32, index_head_dim=128, index_topk=2048, moe_intermediate_size=2048, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, first_k_dense_replace=3,
    ),
}


@dataclass(frozen=True)
class DsaConfig:
    family: DsaFamily
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    #: the indexer rotates its rope dims in interleaved pairs (GLM) or half-split (DeepSeek V3.2)
    indexer_rope_interleaved: bool
    #: per layer: True runs the indexer, False reuses the previous indexer layer's top-k
    indexer_layers: tuple[bool, ...]
    #: MLA's softmax scale: qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2
    softmax_scale: float
    moe: MoeConfig | None = None  # DeepSeek MoE: the sigmoid router (MoeConfig.scoring)

    def __post_init__(self) -> None:
        w = "DsaConfig"
        check_choice(self.family, "family", DSA_FAMILIES, where=w)
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "index_n_heads", "index_head_dim"):
            check_int(getattr(self, name), name, lo=1, hi=MAX_DIM, where=w)
        check_int(self.index_topk, "index_topk", lo=1, hi=MAX_TOPK, where=w)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{w}: qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"{w}: index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim="
                              f"{self.qk_rope_head_dim} (the indexer rotates its first qk_rope_head_dim dims)")
        if not self.indexer_layers or not self.indexer_layers[0]:
            raise ConfigError(f"{w}: the first layer must run the indexer (a 'shared' layer reuses an earlier "
                              "layer's top-k)")
        check_float(self.softmax_scale, "softmax_scale", lo=0, lo_open=True, where=w)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What MLA caches per token: the compressed latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_indexer_layers(self) -> int:
        return sum(self.indexer_layers)

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    def has_dense_layers(self, num_layers: int) -> bool:
        return self.moe is None or len(self.moe.layers) < num_layers


def dsa_from_hf(d: dict[str, Any], family: str, num_layers: int, rope: Any, source: str) -> DsaConfig | None:
    """The DSA settings of a config.json of ``family`` (None for other families); a
    ConfigError naming the key otherwise. ``rope``: the file's resolved RopeConfig."""
    if family not in DSA_FAMILIES:
        return None
    if d.get("quantization_config") is not None:
        raise ConfigError(f"{source}: quantization_config is set; graphcp loads unquantized checkpoints only "
                          "(dequantize the FP8 weights to bfloat16 first)")
    defaults = DEFAULTS[family]

    def num(key: str, lo: int = 1, hi: int = MAX_DIM) -> int:
        v = d.get(key)
        return defaults[key] if v is None and key in defaults else check_int(v, key, lo=lo, hi=hi, where=source)

    if "q_lora_rank" in d and d["q_lora_rank"] is None:
        raise ConfigError(f"{source}: q_lora_rank is null; the DSA indexer's wq_b reads the query latent "
                          "(q_a_layernorm(q_a_proj(x))), so these models need a q_lora_rank")
    heads = d.get("num_attention_heads")
    kv_heads = d.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ConfigError(f"{source}: num_key_value_heads={kv_heads!r} must equal num_attention_heads={heads!r} "
                          "for MLA (every head decompresses its own keys and values from the latent)")
    layers = _indexer_layers(d, num_layers, source) if family == "glm_moe_dsa" else (True,) * num_layers
    nope, rope_dim = num("qk_nope_head_dim"), num("qk_rope_head_dim")
    scale = (nope + rope_dim) ** -0.5
    if rope.rope_type != "default":
        # transformers' yarn_apply_mscale: any non-default RoPE with mscale_all_dim set
        raw = d.get("rope_scaling") or d.get("rope_parameters") or {}
        mscale_all = raw.get("mscale_all_dim") if isinstance(raw, dict) else None
        if mscale_all:
            m = yarn_mscale(rope.factor, check_float(mscale_all, "mscale_all_dim", where=source))
            scale = scale * m * m
    return DsaConfig(
        family=family,  # type: ignore[arg-type]
        q_lora_rank=num("q_lora_rank"), kv_lora_rank=num("kv_lora_rank"), qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim, v_head_dim=num("v_head_dim"), index_n_heads=num("index_n_heads"),
        index_head_dim=num("index_head_dim"), index_topk=num("index_topk", hi=MAX_TOPK),
        indexer_rope_interleaved=family == "glm_moe_dsa", indexer_layers=layers, softmax_scale=scale,
        moe=_moe(d, defaults, num_layers, num, source),
    )


def _moe(d: dict, defaults: dict, num_layers: int, num, source: str) -> MoeConfig | None:
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        dense = min(num("first_k_dense_replace", lo=0, hi=1 << 20), num_layers)
        kinds = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("dense", "sparse") for k in kinds):
        raise ConfigError(f"{source}: mlp_layer_types must list 'dense' or 'sparse' for each of the {num_layers} "
                          f"layers, got {kinds!r}"[:300])
    layers = tuple(i for i, k in enumerate(kinds) if k == "sparse")
    if not layers:
        return None
    norm = d.get("norm_topk_prob")
    scaling = d.get("routed_scaling_factor")
    size = num("moe_intermediate_size", hi=1 << 20)
    return MoeConfig(
        num_experts=num("n_routed_experts", hi=MAX_EXPERTS), top_k=num("num_experts_per_tok", hi=MAX_EXPERTS),
        intermediate_size=size, scoring="sigmoid",
        shared_intermediate_size=size * num("n_shared_experts", lo=0, hi=MAX_EXPERTS),
        n_group=num("n_group", hi=MAX_EXPERTS), topk_group=num("topk_group", hi=MAX_EXPERTS),
        norm_topk_prob=defaults["norm_topk_prob"] if norm is None else check_bool(norm, "norm_topk_prob", where=source),
        routed_scaling_factor=(defaults["routed_scaling_factor"] if scaling is None
                               else check_float(scaling, "routed_scaling_factor", lo=0, lo_open=True, where=source)),
        layers=layers,
    )


def _indexer_layers(d: dict, num_layers: int, source: str) -> tuple[bool, ...]:
    """GLM's per-layer indexer mode, as GlmMoeDsaConfig derives it: ``indexer_types``,
    else ``index_topk_pattern`` ("F"/"S" a layer), else the ``index_topk_freq`` /
    ``index_skip_topk_offset`` schedule (default: every layer runs the indexer)."""
    kinds = d.get("indexer_types")
    if kinds is None and d.get("index_topk_pattern") is not None:
        pattern = d["index_topk_pattern"]
        letters = {"F": "full", "S": "shared"}
        kinds = [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if kinds is None:
        freq = max(check_int(d.get("index_topk_freq", 1), "index_topk_freq", lo=0, hi=1 << 20, where=source), 1)
        offset = check_int(d.get("index_skip_topk_offset", 2), "index_skip_topk_offset", lo=-(1 << 20), hi=1 << 20,
                           where=source)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("full", "shared") for k in kinds):
        raise ConfigError(f"{source}: indexer_types must list 'full' or 'shared' for each of the {num_layers} "
                          f"layers, got {kinds!r}"[:300])
    return tuple(k == "full" for k in kinds)
