"""DsV4Export: one request's cache of a DeepSeek V4 model, format ``graphcp-dsv4/1``:
exactly the state transformers' V4 cache layers (``DeepseekV4HCACache`` /
``DeepseekV4CSACache`` / ``DynamicSlidingWindowLayer``) hold after the request's ``T``
tokens, so a decode engine (or transformers, :func:`graphcp.model.dsv4.hf_cache.to_dsv4_cache`)
continues from it.

Per layer ``i`` (``m``: the layer's compress rate, ``n = T // m`` closed windows,
``r = T - n m`` tokens not yet pooled; the model dtype unless said):

- every layer: ``window.<i>`` ``[min(T, sliding_window - 1), head_dim]``: the last
  tokens' K (= V) after the norm and RoPE (transformers' ``keys[0, 0]``);
- an HCA layer (``m = compress_rates["heavily_compressed_attention"]``):
  ``compressed_kv.<i>`` ``[n, head_dim]``: the compressed entries (after the norm and
  the compress RoPE); ``buffer_kv.<i>`` / ``buffer_gate.<i>`` ``[r, head_dim]``: the raw
  compressor kv and gate projections of tokens ``[n m, T)`` (the gate without
  ``position_bias``, as transformers buffers it);
- a CSA layer: the same for its compressor, two series a token (``buffer_*`` of
  width ``2 head_dim``), and, when ``T >= m``, the overlap state of the last closed
  window's ``m`` tokens, first series only: ``overlap_kv.<i>`` ``[m, head_dim]`` (raw)
  and ``overlap_gate.<i>`` ``[m, head_dim]`` **float32** (the raw gate plus
  ``position_bias[:, :head_dim]``, as transformers keeps it: the sum of a model-dtype
  gate and the float32 bias); then its indexer's, prefixed ``index_``
  (``index_compressed_kv [n, index_head_dim]``, ``index_buffer_kv`` /
  ``index_buffer_gate [r, 2 index_head_dim]``, ``index_overlap_kv [m,
  index_head_dim]``, ``index_overlap_gate [m, index_head_dim]`` float32). Below ``m``
  tokens the overlap tensors are absent (transformers' ``None``).

The entry counts transformers keeps (``entry_count``) are ``n``, and its window's
``cumulative_length`` is ``T``: both follow from the metadata. Metadata
(:class:`DsV4Meta`): tokens, layers, the layer kinds (``sliding`` / ``csa`` / ``hca``),
``head_dim``, ``index_head_dim``, ``sliding_window``, the two compress rates,
``dtype``, the prefill engine's ``page_size`` and the model fingerprint. Flattened (a
transport's region) the tensors follow one another in the order above, layer by layer
(graphcp.pd.layout); only whole layers travel (a V4 cache is replicated: every span is
one layer's whole request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.config import DTYPES, parse_dtype
from graphcp.model.dsv4.cache import CSA, HCA, SLIDING
from graphcp.pd.export import KVFormatError, LayerTensorsExport
from graphcp.pd.layout import TensorLayout

DSV4_FORMAT = "graphcp-dsv4/1"
_INTS = ("num_tokens", "num_layers", "head_dim", "index_head_dim", "sliding_window", "compress_csa",
         "compress_hca", "page_size")
KINDS = (SLIDING, CSA, HCA)
#: the float32 tensors of a model-dtype export
FLOAT32 = ("overlap_gate", "index_overlap_gate")


def compressor_tensors(prefix: str, overlap: bool) -> tuple[str, ...]:
    names = ("compressed_kv", "buffer_kv", "buffer_gate") + (("overlap_kv", "overlap_gate") if overlap else ())
    return tuple(prefix + n for n in names)


def layer_tensor_names(kind: str, num_tokens: int, compress_csa: int) -> tuple[str, ...]:
    """A layer's tensors, in order (a CSA layer's overlap state from its first closed window on)."""
    if kind == SLIDING:
        return ("window",)
    if kind == HCA:
        return ("window",) + compressor_tensors("", False)
    overlap = num_tokens >= compress_csa
    return ("window",) + compressor_tensors("", overlap) + compressor_tensors("index_", overlap)


@dataclass(frozen=True)
class DsV4Meta(TensorLayout):
    num_tokens: int
    num_layers: int
    layer_kinds: tuple[str, ...]  # sliding | csa | hca per layer
    head_dim: int
    index_head_dim: int
    sliding_window: int
    compress_csa: int  # m: tokens per CSA entry
    compress_hca: int  # m': tokens per HCA entry
    dtype: str
    page_size: int
    fingerprint: str
    family: str = "deepseek_v4"
    format: str = DSV4_FORMAT

    token_dim = 0

    def __post_init__(self) -> None:
        for name in _INTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KVFormatError(f"DeepSeek V4 KV metadata: {name} must be an integer >= 1, got {v!r}")
        if self.dtype not in DTYPES:
            raise KVFormatError(f"DeepSeek V4 KV metadata: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        bad = [k for k in self.layer_kinds if k not in KINDS]
        if bad or len(self.layer_kinds) != self.num_layers:
            raise KVFormatError(f"DeepSeek V4 KV metadata: layer_kinds must be {self.num_layers} of {list(KINDS)}, "
                                f"got {list(self.layer_kinds)}")
        if self.format != DSV4_FORMAT:
            raise KVFormatError(f"DeepSeek V4 KV metadata: format {self.format!r} is not {DSV4_FORMAT!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of ``layer`` (0: a sliding layer)."""
        kind = self.layer_kinds[layer]
        return self.compress_csa if kind == CSA else self.compress_hca if kind == HCA else 0

    def entries(self, layer: int, num_tokens: int | None = None) -> int:
        """Entries ``layer`` has pooled after the request's tokens (transformers' ``entry_count``)."""
        m = self.rate(layer)
        return (self.num_tokens if num_tokens is None else num_tokens) // m if m else 0

    def layer_tensors(self, layer: int) -> tuple[str, ...]:
        return layer_tensor_names(self.layer_kinds[layer], self.num_tokens, self.compress_csa)

    def tensor_dtype(self, layer: int, name: str) -> torch.dtype:
        return torch.float32 if name in FLOAT32 else self.torch_dtype

    def tensor_shape(self, layer: int, name: str, num_tokens: int | None = None) -> tuple[int, ...]:
        """Over ``num_tokens`` tokens (default: the request's; a span is always a whole layer)."""
        T = self.num_tokens if num_tokens is None else num_tokens
        if name == "window":
            return (min(T, self.sliding_window - 1), self.head_dim)
        index = name.startswith("index_")
        width = self.index_head_dim if index else self.head_dim
        series = 2 if self.layer_kinds[layer] == CSA else 1
        m, n = self.rate(layer), self.entries(layer, T)
        base = name[len("index_"):] if index else name
        rows = {"compressed_kv": n, "buffer_kv": T - n * m, "buffer_gate": T - n * m, "overlap_kv": m,
                "overlap_gate": m}[base]
        return (rows, series * width if base.startswith("buffer") else width)

    def span_runs(self, layer: int, name: str, start: int, num_tokens: int) -> list[tuple[int, int, int]]:
        """A whole layer's tensor in one run (the rows are not one a token, so only whole
        layers travel); KVFormatError for a part of the request."""
        if (start, num_tokens) != (0, self.num_tokens):
            raise KVFormatError(f"{DSV4_FORMAT}: a span must be layer {layer}'s whole request (positions 0.."
                                f"{self.num_tokens}), got positions {start}..{start + num_tokens}")
        nbytes = self.nbytes_of(layer, name)
        return [(0, self.tensor_offset(layer, name), nbytes)] if nbytes else []

    def make_export(self, layers: list[dict[str, torch.Tensor]], **extra) -> "DsV4Export":
        return DsV4Export(self, layers, **extra)

    def to_dict(self) -> dict[str, str]:
        """String values (a safetensors header holds strings only)."""
        d = {k: str(v) for k, v in vars(self).items()}
        d["layer_kinds"] = ",".join(self.layer_kinds)
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "DeepSeek V4 KV metadata") -> "DsV4Meta":
        missing = [k for k in (*_INTS, "layer_kinds", "dtype", "fingerprint", "format") if k not in d]
        if missing:
            raise KVFormatError(f"{source}: missing DeepSeek V4 KV metadata {missing} (not a {DSV4_FORMAT} export?)")
        try:
            ints = {k: int(d[k]) for k in _INTS}
        except (TypeError, ValueError):
            raise KVFormatError(f"{source}: {', '.join(_INTS)} must be integers, got "
                                f"{ {k: d[k] for k in _INTS} }") from None
        kinds = tuple(k for k in str(d["layer_kinds"]).split(",") if k != "")
        try:
            return cls(**ints, layer_kinds=kinds, dtype=str(d["dtype"]), fingerprint=str(d["fingerprint"]),
                       family=str(d.get("family", "deepseek_v4")), format=str(d["format"]))
        except KVFormatError as e:
            raise KVFormatError(f"{source}: {e}") from None


def dsv4_meta(cfg, num_tokens: int, dtype: str, page_size: int, fingerprint: str) -> DsV4Meta:
    """The export metadata of a V4 model's request (``cfg``: its graphcp ModelConfig)."""
    d = cfg.dsv4
    return DsV4Meta(num_tokens, cfg.num_layers, d.layer_kinds, d.head_dim, d.index_head_dim, d.sliding_window,
                    d.compress_csa, d.compress_hca, dtype, page_size, fingerprint, cfg.family)


@dataclass
class DsV4Export(LayerTensorsExport):
    """One request's V4 cache (module docstring): ``layers[i]`` maps the layer's tensor
    names to tensors. ``token_ids`` and ``last_logits`` ride along as in
    :class:`graphcp.pd.export.KVExport`."""

    meta: DsV4Meta
    SOURCE = "DeepSeek V4 KV export"
