"""GLM-5-Next's text model settings (``Glm5NextForConditionalGeneration``'s language model:
``Glm5NextTextConfig``, under ``text_config``, or at the top level of a text-only
checkpoint), read as transformers 5 reads them and validated up front.

A layer (``layer_types[i]``) is

- ``linear_attention``: Kimi Delta Attention as Kimi Linear's (graphcp.model.kimi_linear),
  its forget gate bounded by ``linear_lower_bound`` and its convolution kept in float32;
- ``indexed_attention`` (``full_attention`` reads the same): MLA with no RoPE
  (``qk_rope_head_dim`` 0) and, where ``indexer_types[i]`` is ``full``, the lightning
  indexer over pooled groups of ``index_kpool`` tokens (``index_kpool_always_select_tail``:
  a row also reads its own incomplete pool); a ``shared`` layer reuses the selection of
  the indexed layer right before it.

Every layer's residual is ``hc_mult`` streams (manifold-constrained hyper-connections,
as DeepSeek V4's); the MLP is dense in the ``mlp_layer_types`` ``dense`` layers and
DeepSeek's MoE elsewhere, both SwiGLUs clamped at ``swiglu_limit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphcp.checks import check_float, check_int
from graphcp.errors import ConfigError
from graphcp.model.config import ConfigReader, ModelConfig, decoder_config, read_head
from graphcp.model.hybrid.export import FULL, LINEAR
from graphcp.model.kimi_linear.config import (
    KdaConfig,
    Keys,
    LatentConfig,
    check_latent_heads,
    even,
    kda_heads,
    kind_list,
    latent_config,
    linear_attn_config,
    sigmoid_moe,
)
from graphcp.model.moe_config import MoeConfig
from graphcp.model.rope import rope_from_hf

MAX_DIM = 1 << 16
#: transformers' Glm5NextTextConfig defaults for the keys read here
GLM_DEFAULTS: dict[str, Any] = dict(
    moe_intermediate_size=2048, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=0, v_head_dim=256,
    qk_nope_head_dim=256, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True, n_shared_experts=1,
    routed_scaling_factor=2.5, num_local_experts=288, linear_head_dim=128, linear_num_heads=64,
    linear_conv_kernel_dim=4, max_position_embeddings=1048576, rms_norm_eps=1e-5, index_topk=2048,
    index_head_dim=128, index_n_heads=32, index_kpool=16, index_kpool_always_select_tail=True, hc_mult=4,
    hc_eps=1e-6, hc_sinkhorn_iters=20, swiglu_limit=10.0,
)
#: GLM-5-Next's spelling of transformers' shared keys: ours -> theirs
GLM_ALIASES = {"num_local_experts": "n_routed_experts"}
#: the first layers transformers makes dense when mlp_layer_types is absent
DENSE_FIRST = 3


@dataclass(frozen=True)
class PooledIndexer:
    """The lightning indexer over pools of ``kpool`` tokens."""

    n_heads: int
    head_dim: int
    topk: int  # tokens: topk // kpool pools a row
    kpool: int
    #: per layer: runs the indexer (an indexed 'full' layer); False: a KDA or 'shared' layer
    layers: tuple[bool, ...]
    #: per layer: an indexed 'shared' layer (it reuses the selection of the layer before it)
    shared: tuple[bool, ...]

    @property
    def pools(self) -> int:
        """The pools a row selects."""
        return self.topk // self.kpool

    @property
    def width(self) -> int:
        """A row's selection in tokens: its pools and its own incomplete pool (at most
        ``kpool - 1`` tokens): transformers' output width."""
        return self.topk + self.kpool - 1

    @property
    def carried(self) -> frozenset[int]:
        """The indexer layers whose selection the next layer reuses."""
        return frozenset(i - 1 for i, s in enumerate(self.shared) if s)


@dataclass(frozen=True)
class HyperConfig:
    """The residual's streams (``hc_mult``) and their Sinkhorn normalisation."""

    mult: int
    sinkhorn_iters: int
    eps: float


@dataclass(frozen=True)
class Glm5Config:
    """GLM-5-Next's settings (``ModelConfig.hybrid``; ``kda`` and ``latent`` as the KDA
    hybrids' cache and export read them)."""

    kda: KdaConfig
    latent: LatentConfig
    moe: MoeConfig | None
    indexer: PooledIndexer
    hc: HyperConfig
    swiglu_limit: float | None
    prefix: str = "model.language_model."


def text_part(d: dict[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """The text model's config (``text_config``, or a flat text-only checkpoint) with the
    top level's dtype and tied embeddings, and where errors name it."""
    text = d.get("text_config")
    if text is None:
        return d, source
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: text_config must be an object, got {text!r}"[:300])
    text = dict(text)
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if d.get(key) is not None:
            text[key] = d[key]
    return text, f"{source}: text_config"


def layer_kinds(d: dict, num_layers: int, source: str) -> tuple[str, ...]:
    """``layer_types``, else transformers' default (an indexed layer every fourth, from layer 3)."""
    if d.get("layer_types") is None:
        return tuple(FULL if i % 4 == 3 else LINEAR for i in range(num_layers))
    return kind_list(d["layer_types"], "layer_types", num_layers,
                     {"linear_attention": LINEAR, "indexed_attention": FULL, "full_attention": FULL}, source)


def indexer_kinds(d: dict, kinds: tuple[str, ...], source: str) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """(runs the indexer, is 'shared') per layer, from ``indexer_types`` (else the
    ``index_topk_pattern`` or the ``index_topk_freq`` / ``index_skip_topk_offset`` schedule,
    as transformers derives it); a 'shared' indexed layer must follow a 'full' indexed one."""
    n = len(kinds)
    types = d.get("indexer_types")
    if types is None and d.get("index_topk_pattern") is not None:
        pattern = d["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq = max(check_int(d.get("index_topk_freq", 1), "index_topk_freq", lo=0, hi=1 << 20, where=source), 1)
        offset = check_int(d.get("index_skip_topk_offset", 2), "index_skip_topk_offset", lo=-(1 << 20), hi=1 << 20,
                           where=source)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    marks = kind_list(types, "indexer_types", n, {"full": "full", "shared": "shared"}, source)
    full = tuple(k == FULL and m == "full" for k, m in zip(kinds, marks))
    shared = tuple(k == FULL and m == "shared" for k, m in zip(kinds, marks))
    for i, s in enumerate(shared):
        if s and not (i > 0 and full[i - 1]):
            raise ConfigError(f"{source}: layer {i} is a 'shared' indexed layer (indexer_types) but layer {i - 1} is "
                              "not a 'full' indexed layer; a shared layer reuses the top-k of the layer right before "
                              "it (transformers passes it from that layer only)")
    return full, shared


def pooled_indexer(k: Keys, kinds: tuple[str, ...]) -> PooledIndexer:
    src = k.source
    topk, kpool = k.num("index_topk", hi=1 << 24), k.num("index_kpool", hi=MAX_DIM)
    if topk % kpool:
        raise ConfigError(f"{src}: index_topk={topk} must be divisible by index_kpool={kpool} (a row selects "
                          "index_topk / index_kpool pools)")
    if not k.flag("index_kpool_always_select_tail"):
        raise ConfigError(f"{src}: index_kpool_always_select_tail=false is not supported: a row before its first "
                          "complete pool would select no key at all (transformers then attends to nothing under "
                          "SDPA); the selection built here always adds a row's own incomplete pool")
    full, shared = indexer_kinds(k.d, kinds, src)
    return PooledIndexer(k.num("index_n_heads", hi=MAX_DIM), k.num("index_head_dim", hi=MAX_DIM), topk, kpool, full,
                         shared)


def lower_bound(k: Keys, lac: dict) -> float | None:
    """``linear_lower_bound`` (or ``linear_attn_config``'s ``gate_lower_bound``, whose
    ``safe_gate`` makes a missing one -5, as transformers reads them); None: Kimi's gate."""
    v = k.d.get("linear_lower_bound", -5.0)
    if lac:
        v = lac.get("gate_lower_bound", v)
        if v is None and lac.get("safe_gate", True):
            v = -5.0
    return None if v is None else check_float(v, "linear_lower_bound", where=k.source)


def read_glm5next(d: dict[str, Any], model_type: str, source: str) -> ModelConfig:
    """The ModelConfig of a GLM-5-Next config.json (its text model)."""
    text, src = text_part(d, source)
    k = Keys(text, src, GLM_DEFAULTS, GLM_ALIASES)
    resolved = k.resolved()
    for key in ("max_position_embeddings", "rms_norm_eps"):
        if resolved.get(key) is None:
            resolved[key] = GLM_DEFAULTS[key]
    resolved.pop("head_dim", None)  # (transformers forces head_dim to the rope width, 0)
    r = ConfigReader(resolved, src)
    head = read_head(r)
    check_latent_heads(text, src)
    kinds = layer_kinds(text, head.num_layers, src)
    lac = linear_attn_config(text, src)
    heads, dim, kernel = kda_heads(k, lac)
    try:
        kda = KdaConfig(kinds, heads, dim, kernel, lower_bound(k, lac), conv_float32=True)
    except ConfigError as e:
        raise ConfigError(f"{src}: {str(e).removeprefix('KdaConfig: ')}") from None
    latent = latent_config(k, check_float(head.eps, "rms_norm_eps", lo=0.0, hi=1.0, where=src))
    if latent.q_lora_rank is None:
        raise ConfigError(f"{src}: q_lora_rank is required (GLM-5-Next's indexer reads the query latent)")
    if latent.qk_rope_head_dim:
        raise ConfigError(f"{src}: qk_rope_head_dim={latent.qk_rope_head_dim}: GLM-5-Next's indexed layers have no "
                          "RoPE (transformers requires 0)")
    indexer = pooled_indexer(k, kinds)
    hc = HyperConfig(k.num("hc_mult", hi=64), k.num("hc_sinkhorn_iters", hi=1 << 10),
                     k.real("hc_eps", lo=0.0, hi=1.0))
    limit = k.raw("swiglu_limit")
    moe = sigmoid_moe(k, head.num_layers, DENSE_FIRST)
    rope = rope_from_hf(resolved, src, head.max_positions)
    settings = Glm5Config(kda, latent, moe, indexer, hc, None if limit is None else float(limit))
    return decoder_config(r, model_type, head, rope, head_dim=even(latent.qk_head_dim), num_kv_heads=head.num_heads,
                          moe=moe, hybrid=settings)
