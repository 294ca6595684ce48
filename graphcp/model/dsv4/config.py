"""DeepSeek V4 settings (``DeepseekV4ForCausalLM``), read from a config.json as
transformers 5 reads them (``transformers.models.deepseek_v4``), validated up front.

What a V4 decoder layer is (docs/dsv4.md):

- attention: shared-KV MQA (one KV head of ``head_dim``, K and V the same tensor),
  queries through a low-rank ``q_lora_rank`` projection, partial interleaved RoPE on the
  trailing ``rope_dim`` channels (undone on the output), a learned sink per head, and a
  grouped low-rank output projection (``o_groups`` x ``o_lora_rank``);
- each layer's kind (``layer_types``): ``sliding`` (a window of ``sliding_window``
  keys only), ``csa`` (the window plus compressed entries, one per ``compress_rates
  ["compressed_sparse_attention"]`` tokens, pooled over overlapping windows, of which a
  lightning indexer keeps ``index_topk`` per query) or ``hca`` (the window plus every
  compressed entry, one per ``compress_rates["heavily_compressed_attention"]`` tokens);
- the residual is ``hc_mult`` streams (mHC), mixed by Sinkhorn-normalised weights;
- every layer's FFN is a MoE with one shared expert: routed by ``scoring_func`` scores
  (``mlp_layer_types`` "moe") or by the token id (``hash_moe``: a ``tid2eid`` table).

Sliding layers rotate with the ``main`` RoPE (``rope_theta``); compressed layers, their
compressors and indexer with the ``compress`` RoPE (``compress_rope_theta``, YaRN when
the config asks, attention factor 1 as transformers forces it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphcp.checks import MAX_TOKENS, check_float, check_int, check_str
from graphcp.errors import ConfigError
from graphcp.model.dsv4.cache import CSA, HCA, SLIDING, DsV4CacheSpec
from graphcp.model.moe_config import MoeConfig
from graphcp.model.rope import RopeConfig, rope_from_hf

#: transformers' layer_types names -> ours
LAYER_KINDS = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA,
               "heavily_compressed_attention": HCA}
#: the router score functions transformers' DeepseekV4TopKRouter takes (ACT2FN names)
SCORING = ("sqrtsoftplus", "sigmoid", "softmax")
FAMILY = "deepseek_v4"


@dataclass(frozen=True)
class DsV4Config:
    layer_kinds: tuple[str, ...]  # SLIDING / CSA / HCA per layer
    hash_layers: tuple[bool, ...]  # the layer's MoE routes by token id (hash_moe)
    head_dim: int
    rope_dim: int  # the trailing channels of each head that RoPE rotates
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_csa: int  # m: tokens per CSA compressed entry (overlapping windows of 2m)
    compress_hca: int  # m': tokens per HCA compressed entry
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    scoring_func: str
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    main_rope: RopeConfig
    compress_rope: RopeConfig

    def __post_init__(self) -> None:
        w = "DsV4Config"
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ConfigError(f"{w}: the rotated dims head_dim x partial_rotary_factor = {self.rope_dim} must be "
                              f"even and in 2..head_dim={self.head_dim}")
        if self.rope_dim > self.index_head_dim and CSA in self.layer_kinds:
            raise ConfigError(f"{w}: index_head_dim={self.index_head_dim} is smaller than the rotated dims "
                              f"{self.rope_dim} (the indexer rotates its trailing rope dims)")

    @property
    def cache(self) -> DsV4CacheSpec:
        """The sizes the cache and the attention break read."""
        return DsV4CacheSpec(self.layer_kinds, self.head_dim, self.index_head_dim, self.compress_csa,
                             self.compress_hca)

    @property
    def moe(self) -> MoeConfig:
        """The experts' sizes (the parallel checks and the MoE block read them; the routing
        is V4's own: graphcp/model/dsv4/moe.py)."""
        return MoeConfig(num_experts=self.num_experts, top_k=self.top_k, intermediate_size=self.moe_intermediate_size,
                         norm_topk_prob=True, layers=tuple(range(len(self.layer_kinds))),
                         shared_intermediate_size=self.moe_intermediate_size,
                         routed_scaling_factor=self.routed_scaling_factor)


def _kinds(d: dict, key: str, allowed: dict | tuple, num_layers: int, source: str, default: list) -> list:
    v = d.get(key)
    v = default if v is None else v
    if not isinstance(v, list) or len(v) != num_layers:
        raise ConfigError(f"{source}: {key} must be a list of {num_layers} entries (num_hidden_layers), "
                          f"got {v!r}"[:300])
    bad = [x for x in v if x not in allowed]
    if bad:
        raise ConfigError(f"{source}: {key} entry {bad[0]!r} is not one of {sorted(allowed)}")
    return v


def _rope(p: Any, label: str, source: str, max_pos: int | None) -> RopeConfig:
    if not isinstance(p, dict):
        raise ConfigError(f"{source}: rope_parameters[{label!r}] must be an object, got {p!r}"[:300])
    p = {k: v for k, v in p.items() if k != "partial_rotary_factor"}  # read once, as rope_dim
    return rope_from_hf({"rope_parameters": p}, f"{source}: rope_parameters[{label!r}]", max_pos)


def dsv4_from_hf(d: dict[str, Any], family: str, num_layers: int, max_pos: int | None,
                 source: str) -> DsV4Config | None:
    """The V4 settings of a config.json (None for another family); defaults as
    transformers' DeepseekV4Config."""
    if family != FAMILY:
        return None

    def num(key: str, default: int, lo: int = 1, hi: int = 1 << 20) -> int:
        v = d.get(key)
        return default if v is None else check_int(v, key, lo=lo, hi=hi, where=source)

    def real(key: str, default: float, **kw) -> float:
        v = d.get(key)
        return default if v is None else check_float(v, key, where=source, **kw)

    n_hc = 2 if num_layers >= 2 else num_layers
    default_kinds = (["heavily_compressed_attention"] * n_hc
                     + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                        for i in range(max(num_layers - 2, 0))])
    kinds = _kinds(d, "layer_types", LAYER_KINDS, num_layers, source, default_kinds)
    mlp = _kinds(d, "mlp_layer_types", ("hash_moe", "moe"), num_layers, source,
                 ["hash_moe"] * min(num_layers, 3) + ["moe"] * max(0, num_layers - 3))
    rates = d.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise ConfigError(f"{source}: compress_rates must be an object, got {rates!r}"[:300])
    csa = check_int(rates.get("compressed_sparse_attention", 4), "compress_rates.compressed_sparse_attention", lo=1,
                    hi=MAX_TOKENS, where=source)
    hca = check_int(rates.get("heavily_compressed_attention", 128), "compress_rates.heavily_compressed_attention",
                    lo=1, hi=MAX_TOKENS, where=source)
    head_dim = num("head_dim", 512)
    prf = d.get("partial_rotary_factor")
    prf = 64 / 512 if prf is None else check_float(prf, "partial_rotary_factor", lo=0, lo_open=True, hi=1,
                                                       where=source)
    scoring = check_str(d.get("scoring_func", "sqrtsoftplus"), "scoring_func", where=source)
    if scoring not in SCORING:
        raise ConfigError(f"{source}: scoring_func {scoring!r} is not supported; expected one of {list(SCORING)}")
    shared = num("n_shared_experts", 1, lo=0)
    if shared != 1:
        raise ConfigError(f"{source}: n_shared_experts={shared}; DeepSeek V4 (transformers) has exactly one shared "
                          "expert")
    if num("num_key_value_heads", 1) != 1:
        raise ConfigError(f"{source}: num_key_value_heads must be 1 (V4 attention is shared-KV MQA)")
    rp = d.get("rope_parameters") or {}
    if not (isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)):
        raise ConfigError(f"{source}: rope_parameters must hold 'main' and 'compress' objects (transformers 5 writes "
                          f"them), got {rp!r}"[:300])
    experts = num("n_routed_experts", 256)
    top_k = num("num_experts_per_tok", 6)
    if top_k > experts:
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    cfg = DsV4Config(
        layer_kinds=tuple(LAYER_KINDS[k] for k in kinds),
        hash_layers=tuple(k == "hash_moe" for k in mlp),
        head_dim=head_dim,
        rope_dim=int(head_dim * prf),
        q_lora_rank=num("q_lora_rank", 1024),
        o_groups=num("o_groups", 8),
        o_lora_rank=num("o_lora_rank", 1024),
        sliding_window=num("sliding_window", 128, hi=MAX_TOKENS),
        compress_csa=csa,
        compress_hca=hca,
        index_n_heads=num("index_n_heads", 64),
        index_head_dim=num("index_head_dim", 128),
        index_topk=num("index_topk", 512, hi=MAX_TOKENS),
        hc_mult=num("hc_mult", 4, hi=64),
        hc_sinkhorn_iters=num("hc_sinkhorn_iters", 20, hi=1000),
        hc_eps=real("hc_eps", 1e-6, lo=0),
        swiglu_limit=real("swiglu_limit", 10.0, lo=0, lo_open=True),
        scoring_func=scoring,
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=num("moe_intermediate_size", 2048),
        routed_scaling_factor=real("routed_scaling_factor", 1.5, lo=0, lo_open=True),
        main_rope=_rope(rp["main"], "main", source, max_pos),
        compress_rope=_rope(rp["compress"], "compress", source, max_pos),
    )
    heads = d.get("num_attention_heads")
    if isinstance(heads, int) and heads % cfg.o_groups:
        raise ConfigError(f"{source}: num_attention_heads={heads} does not divide into o_groups={cfg.o_groups}")
    return cfg
