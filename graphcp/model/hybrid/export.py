"""HybridExport: one request's cache of a linear-attention hybrid, format
``graphcp-hybrid/1``: exactly what transformers' cache of a Qwen3.5 / Qwen3-Next model
holds after the request's ``T`` tokens, so a decode engine (or transformers,
:func:`graphcp.model.hybrid.hf_cache.to_hybrid_cache`) continues from it.

Per layer ``i``:

- a full-attention layer: ``k.<i>``, ``v.<i>`` ``[num_kv_heads, T, head_dim]`` in the
  model dtype, keys after RoPE (as graphcp-kv/1);
- a linear-attention layer: ``conv.<i>`` ``[conv_dim, conv_kernel]`` (the model dtype):
  the last ``conv_kernel`` pre-convolution rows, oldest first, zeros before the first
  token (transformers' ``conv_states``; channels: q of every key head, k, then v of
  every value head), and ``recurrent.<i>`` ``[num_v_heads, k_head_dim, v_head_dim]``
  **float32**: the gated delta rule's state (transformers' ``recurrent_states``).

Metadata (:class:`HybridMeta`): tokens, layers, the layer kinds (``linear`` /
``full``), the full layers' KV heads and head_dim, the linear layers' key and value
heads and dims and conv kernel, ``dtype``, the prefill engine's ``page_size`` and the
model fingerprint. Flattened (a transport's region) the tensors follow one another layer
by layer in the order above (graphcp.pd.layout); a full layer's K/V may travel in runs of
positions, a linear layer's states only whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from graphcp.config import DTYPES, parse_dtype
from graphcp.pd.export import KVFormatError, LayerTensorsExport, take_kv_heads
from graphcp.pd.layout import TensorLayout

HYBRID_FORMAT = "graphcp-hybrid/1"
LINEAR, FULL = "linear", "full"
_INTS = ("num_tokens", "num_layers", "num_kv_heads", "head_dim", "num_k_heads", "num_v_heads", "k_head_dim",
         "v_head_dim", "conv_kernel", "page_size")


@dataclass(frozen=True)
class HybridMeta(TensorLayout):
    num_tokens: int
    num_layers: int
    layer_kinds: tuple[str, ...]  # linear | full per layer
    num_kv_heads: int
    head_dim: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    dtype: str
    page_size: int
    fingerprint: str
    family: str = "qwen3_5_text"
    format: str = HYBRID_FORMAT
    #: the last ``draft_layers`` of the ``num_layers`` are an EAGLE-3 draft's (full: K/V, after
    #: the model's layers, as graphcp-kv/1 carries them: docs/speculative.md)
    draft_layers: int = 0

    token_dim = 1  # a full layer's [heads, tokens, head_dim]

    def __post_init__(self) -> None:
        for name in _INTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KVFormatError(f"hybrid KV metadata: {name} must be an integer >= 1, got {v!r}")
        if self.dtype not in DTYPES:
            raise KVFormatError(f"hybrid KV metadata: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if len(self.layer_kinds) != self.num_layers or set(self.layer_kinds) - {LINEAR, FULL}:
            raise KVFormatError(f"hybrid KV metadata: layer_kinds must be {self.num_layers} of linear / full, got "
                                f"{list(self.layer_kinds)}")
        if self.format != HYBRID_FORMAT:
            raise KVFormatError(f"hybrid KV metadata: format {self.format!r} is not {HYBRID_FORMAT!r}")
        d = self.draft_layers
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < self.num_layers or \
                any(k != FULL for k in self.layer_kinds[self.num_layers - d:]):
            raise KVFormatError(f"hybrid KV metadata: draft_layers must be an integer in [0, {self.num_layers}) of "
                                f"full layers at the end, got {d!r}")

    @property
    def target_layers(self) -> int:
        """The model's layers (a draft's follow them)."""
        return self.num_layers - self.draft_layers

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def layer_tensors(self, layer: int) -> tuple[str, ...]:
        return ("k", "v") if self.layer_kinds[layer] == FULL else ("conv", "recurrent")

    def tensor_dtype(self, layer: int, name: str) -> torch.dtype:
        return torch.float32 if name == "recurrent" else self.torch_dtype

    def tensor_shape(self, layer: int, name: str, num_tokens: int | None = None) -> tuple[int, ...]:
        if name in ("k", "v"):
            return (self.num_kv_heads, self.num_tokens if num_tokens is None else num_tokens, self.head_dim)
        if name == "conv":
            return (self.conv_dim, self.conv_kernel)
        return (self.num_v_heads, self.k_head_dim, self.v_head_dim)

    def span_runs(self, layer: int, name: str, start: int, num_tokens: int) -> list[tuple[int, int, int]]:
        if self.layer_kinds[layer] == FULL:
            return super().span_runs(layer, name, start, num_tokens)
        if (start, num_tokens) != (0, self.num_tokens):
            raise KVFormatError(f"{HYBRID_FORMAT}: linear layer {layer}'s states travel whole (positions 0.."
                                f"{self.num_tokens}), got positions {start}..{start + num_tokens}")
        return [(0, self.tensor_offset(layer, name), self.nbytes_of(layer, name))]

    # ---- attention TP: each rank's cache holds its heads (graphcp.pd.heads) ----------------
    def head_shard(self, size: int) -> "HybridMeta":
        """One attention-TP rank's share (its own KV, key and value heads)."""
        kv = self.num_kv_heads // size if self.num_kv_heads >= size else 1
        return replace(self, num_kv_heads=kv, num_k_heads=self.num_k_heads // size,
                       num_v_heads=self.num_v_heads // size)

    def merge_heads(self, layer: int, name: str, gathered: torch.Tensor, size: int) -> torch.Tensor:
        """The whole tensor from the attention-TP ranks' shares, all-gathered rank-major
        along dim 0: K/V heads (a replicated one kept once) and states in head order;
        the conv channels regrouped (each rank holds q, k and v of its own heads)."""
        if name in ("k", "v"):
            H = self.num_kv_heads
            return (gathered if gathered.shape[0] == H else gathered[:: size // H]).contiguous()
        if name == "recurrent":
            return gathered.contiguous()
        q, k = self.num_k_heads * self.k_head_dim // size, self.num_k_heads * self.k_head_dim // size
        parts = gathered.view(size, -1, self.conv_kernel).split([q, k, self.num_v_heads * self.v_head_dim // size], 1)
        return torch.cat([p.reshape(-1, self.conv_kernel) for p in parts]).contiguous()

    def take_heads(self, layer: int, name: str, whole: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        """Attention-TP rank ``rank``'s share of a whole tensor (the inverse of
        :meth:`merge_heads`): its K/V heads, its value heads' recurrent states, and its
        q, k and v conv channels."""
        if name in ("k", "v"):
            return take_kv_heads(whole, self.num_kv_heads, size, rank)
        if name == "recurrent":
            n = self.num_v_heads // size
            return whole[rank * n:(rank + 1) * n]
        qk, v = self.num_k_heads * self.k_head_dim, self.num_v_heads * self.v_head_dim
        return torch.cat([p.chunk(size, 0)[rank] for p in whole.split([qk, qk, v], 0)])

    def make_export(self, layers: list[dict[str, torch.Tensor]], **extra) -> "HybridExport":
        return HybridExport(self, layers, **extra)

    def to_dict(self) -> dict[str, str]:
        """String values (a safetensors header holds strings only)."""
        # (draft_layers only when a draft's layers ride along: other exports keep their header)
        d = {k: str(v) for k, v in vars(self).items() if k != "draft_layers" or v}
        d["layer_kinds"] = ",".join(self.layer_kinds)
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "hybrid KV metadata") -> "HybridMeta":
        missing = [k for k in (*_INTS, "layer_kinds", "dtype", "fingerprint", "format") if k not in d]
        if missing:
            raise KVFormatError(f"{source}: missing hybrid KV metadata {missing} (not a {HYBRID_FORMAT} export?)")
        try:
            ints = {k: int(d[k]) for k in _INTS}
        except (TypeError, ValueError):
            raise KVFormatError(f"{source}: {', '.join(_INTS)} must be integers, got "
                                f"{ {k: d[k] for k in _INTS} }") from None
        kinds = tuple(k for k in str(d["layer_kinds"]).split(",") if k)
        try:
            return cls(**ints, layer_kinds=kinds, dtype=str(d["dtype"]), fingerprint=str(d["fingerprint"]),
                       family=str(d.get("family", "qwen3_5_text")), format=str(d["format"]),
                       draft_layers=int(d.get("draft_layers", 0)))
        except KVFormatError as e:
            raise KVFormatError(f"{source}: {e}") from None


@dataclass
class HybridExport(LayerTensorsExport):
    """One request's hybrid cache (module docstring): ``layers[i]`` maps the layer's tensor
    names to tensors. ``token_ids`` and ``last_logits`` ride along as in
    :class:`graphcp.pd.export.KVExport`."""

    meta: HybridMeta
    SOURCE = "hybrid KV export"
