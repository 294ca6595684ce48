"""A linear-attention hybrid's settings, read from a config.json as transformers 5 reads
them (``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``, ``Qwen3NextConfig``; the
multimodal ``Qwen3_5Config`` / ``Qwen3_5MoeConfig``'s ``text_config``), validated up front.

What a hybrid's decoder layer is (docs/hybrid.md):

- ``layer_types[i]``: ``linear_attention`` (Gated DeltaNet: a causal depthwise
  convolution of ``linear_conv_kernel_dim`` over the q/k/v projections, then the gated
  delta rule with ``linear_num_key_heads`` key heads of ``linear_key_head_dim`` serving
  ``linear_num_value_heads`` value heads of ``linear_value_head_dim``, a gated RMSNorm
  and ``out_proj``) or ``full_attention`` (causal attention with an output gate per head,
  q/k RMSNorm and RoPE on the first ``head_dim x partial_rotary_factor`` channels);
- the MLP: dense (Qwen3.5), a MoE with a gated shared expert in every layer
  (Qwen3.5-MoE), or Qwen3-MoE's sparse/dense pattern with a gated shared expert (Qwen3-Next);
- every RMSNorm but the gated one scales by ``1 + weight`` (zero-centred weights).

Qwen3-Next packs its linear layers' projections per key head (``in_proj_qkvz``,
``in_proj_ba``); Qwen3.5 keeps them apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``). The multimodal checkpoints' text model is ``model.language_model.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphcp.checks import check_float, check_int
from graphcp.errors import ConfigError
from graphcp.model.hybrid.export import FULL, LINEAR
from graphcp.model.moe_config import MAX_EXPERTS, MAX_INTERMEDIATE, MoeConfig
from graphcp.model.rope import RopeConfig, rope_from_hf

#: transformers' layer_types names -> ours
LAYER_KINDS = {"linear_attention": LINEAR, "full_attention": FULL}
#: convolution widths the kernels take (causal-conv1d's CUDA kernels: 2, 3 and 4)
CONV_KERNELS = (2, 3, 4)
#: the largest key or value head (fla's chunked kernels tile a head in one block of <= 256)
MAX_LINEAR_HEAD_DIM = 256
#: model_type -> (the text model's MLP: dense / every layer MoE / Qwen3-Next's pattern,
#: the projections packed per key head, a multimodal checkpoint)
FLAVOURS = {
    "qwen3_5_text": ("dense", False, False),
    "qwen3_5": ("dense", False, True),
    "qwen3_5_moe_text": ("moe", False, False),
    "qwen3_5_moe": ("moe", False, True),
    "qwen3_next": ("next", True, False),
}
#: the RoPE keys a hybrid reads itself (the rest go to graphcp.model.rope): the rotated
#: share, and the multimodal sections (text positions are equal in all three: plain RoPE)
_OWN_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


@dataclass(frozen=True)
class HybridConfig:
    layer_kinds: tuple[str, ...]  # LINEAR / FULL per layer
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    #: the channels of a full-attention head RoPE rotates (the first ones)
    rotary_dim: int
    #: the full-attention layers' query heads (a rank's linear heads are the same share
    #: of the model's under attention TP)
    attention_heads: int
    #: Qwen3-Next's in_proj_qkvz / in_proj_ba, packed per key head
    packed: bool = False
    #: where the text model's tensors are in the checkpoint
    prefix: str = "model."

    def __post_init__(self) -> None:
        w = "HybridConfig"
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"{w}: linear_num_value_heads={self.num_v_heads} is not a multiple of "
                              f"linear_num_key_heads={self.num_k_heads} (each key head serves the same number of "
                              "value heads)")
        if self.conv_kernel not in CONV_KERNELS:
            raise ConfigError(f"{w}: linear_conv_kernel_dim={self.conv_kernel} is not supported; the convolution "
                              f"kernels take widths {', '.join(map(str, CONV_KERNELS))}")
        for key, value in (("linear_key_head_dim", self.k_head_dim), ("linear_value_head_dim", self.v_head_dim)):
            check_int(value, key, lo=1, hi=MAX_LINEAR_HEAD_DIM, where=w)
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ConfigError(f"{w}: the rotated channels head_dim x partial_rotary_factor = {self.rotary_dim} must "
                              "be even and >= 2")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == FULL)

    @property
    def group(self) -> int:
        """Value heads a key head serves."""
        return self.num_v_heads // self.num_k_heads

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: q and k of every key head, v of every value head."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def share(self, attention_heads: int) -> int:
        """The attention-TP degree a rank holding ``attention_heads`` query heads runs at."""
        return self.attention_heads // attention_heads


def text_part(d: dict[str, Any], model_type: str, source: str) -> tuple[dict[str, Any], str, str]:
    """The text model's config, where errors name it, and its tensors' prefix: a
    multimodal checkpoint's ``text_config`` (its dtype and tied embeddings are the
    top level's, as transformers ties ``lm_head`` to the text model's embedding)."""
    if not FLAVOURS[model_type][2]:
        return d, source, "model."
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a {model_type} checkpoint needs a text_config object, got {text!r}"[:300])
    text = dict(text)
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if d.get(key) is not None:
            text[key] = d[key]
    return text, f"{source}: text_config", "model.language_model."


def _layer_kinds(d: dict, num_layers: int, source: str) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is None:  # transformers: full attention every full_attention_interval layers
        every = check_int(d.get("full_attention_interval", 4), "full_attention_interval", lo=1, hi=1 << 20,
                          where=source)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        n = len(types) if isinstance(types, list) else None
        raise ConfigError(f"{source}: layer_types lists {n} entries, expected num_hidden_layers={num_layers}: "
                          f"{types!r}"[:300])
    bad = [t for t in types if t not in LAYER_KINDS]
    if bad:
        raise ConfigError(f"{source}: layer_types entry {bad[0]!r} is not one of {sorted(LAYER_KINDS)}")
    return tuple(LAYER_KINDS[t] for t in types)


def hybrid_rope(d: dict[str, Any], source: str, max_positions: int | None, head_dim: int) -> tuple[RopeConfig, int]:
    """The full-attention layers' RoPE and how many channels of a head it rotates
    (``partial_rotary_factor``: transformers' default 0.25)."""
    params = d.get("rope_parameters")
    factor = None
    if isinstance(params, dict):
        factor = params.get("partial_rotary_factor")
        params = {k: v for k, v in params.items() if k not in _OWN_ROPE_KEYS}
    top = d.get("partial_rotary_factor")
    if factor is not None and top is not None and factor != top:
        raise ConfigError(f"{source}: partial_rotary_factor={top!r} disagrees with rope_parameters' {factor!r}")
    factor = 0.25 if factor is None and top is None else factor if factor is not None else top
    factor = check_float(factor, "partial_rotary_factor", lo=0, lo_open=True, hi=1, where=source)
    clean = {k: v for k, v in d.items() if k not in ("partial_rotary_factor", "rope_parameters")}
    if params is not None:
        clean["rope_parameters"] = params
    return rope_from_hf(clean, source, max_positions), int(head_dim * factor)


def hybrid_from_hf(d: dict[str, Any], model_type: str, num_layers: int, attention_heads: int, rotary_dim: int,
                   prefix: str, source: str) -> HybridConfig:
    """The hybrid settings of a text config (defaults as transformers' config classes)."""

    def num(key: str, default: int, hi: int = 1 << 16) -> int:
        v = d.get(key)
        return default if v is None else check_int(v, key, lo=1, hi=hi, where=source)

    kinds = _layer_kinds(d, num_layers, source)
    try:
        return HybridConfig(kinds, num("linear_num_key_heads", 16), num("linear_num_value_heads", 32),
                            num("linear_key_head_dim", 128), num("linear_value_head_dim", 128),
                            num("linear_conv_kernel_dim", 4), rotary_dim, attention_heads,
                            packed=FLAVOURS[model_type][1], prefix=prefix)
    except ConfigError as e:
        raise ConfigError(f"{source}: {str(e).removeprefix('HybridConfig: ')}") from None


def hybrid_moe(d: dict[str, Any], model_type: str, num_layers: int, source: str) -> MoeConfig | None:
    """The MoE of a hybrid (None: dense): Qwen3.5-MoE's in every layer, Qwen3-Next's where
    ``mlp_only_layers`` and ``decoder_sparse_step`` say (Qwen3-MoE's rule); both with a
    shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate, the top-k
    weights cast to the model's dtype (as transformers)."""
    kind = FLAVOURS[model_type][0]
    if kind == "dense":
        return None

    def num(key: str, default: int, lo: int = 1, hi: int = MAX_EXPERTS) -> int:
        v = d.get(key)
        return default if v is None else check_int(v, key, lo=lo, hi=hi, where=source)

    experts = num("num_experts", 256 if kind == "moe" else 512, lo=0)
    if experts == 0:  # transformers builds every layer dense then
        return None
    layers = tuple(range(num_layers))
    norm = True
    if kind == "next":
        step = num("decoder_sparse_step", 1, hi=max(1, num_layers))
        only = d.get("mlp_only_layers") or []
        if not isinstance(only, list):
            raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}"[:300])
        dense = {check_int(i, "mlp_only_layers entry", lo=0, hi=num_layers - 1, where=source) for i in only}
        layers = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
        norm_v = d.get("norm_topk_prob")
        norm = True if norm_v is None else bool(norm_v)
    top_k = num("num_experts_per_tok", 8 if kind == "moe" else 10)
    if top_k > experts:
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} exceeds the {experts} experts")
    if not layers:
        return None
    return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=num("moe_intermediate_size", 512,
                                                                              hi=MAX_INTERMEDIATE),
                     norm_topk_prob=norm, layers=layers,
                     shared_intermediate_size=num("shared_expert_intermediate_size", 512, hi=MAX_INTERMEDIATE),
                     weights_in_model_dtype=True)
