"""KdaExport: one request's cache of a KDA hybrid, format ``graphcp-kda/1`` (Kimi Linear;
GLM-5-Next's text model keeps the same layout under its own name, graphcp.model.glm5_next.export):
exactly what transformers' cache of the model holds after the request's ``T`` tokens,
so a decode engine (or transformers, graphcp.model.kimi_linear.hf_cache) continues
from it.

Per layer ``i``:

- an MLA layer: ``latent`` ``[T, kv_lora_rank]`` (``kv_a_layernorm``'s output:
  transformers' ``cache.layers[i].keys[0, 0]``), ``rope_key`` ``[T, qk_rope_head_dim]``
  (the shared key slice, never rotated: ``values[0, 0]``; absent when the model has none)
  and, in a layer that runs GLM-5-Next's pooled indexer, ``index_key`` and ``index_gate``
  ``[T, index_head_dim]`` (the indexer's key and its pooling gate: transformers'
  ``indexer_keys[0]`` without the validity column);
- a KDA layer: ``conv`` ``[3 H d, K]`` (the model dtype; the last ``K`` pre-convolution
  rows of q, k and v, oldest first, zeros before the first token: transformers'
  ``conv_states``) and ``recurrent`` ``[H, d, d]`` **float32** (``recurrent_states``).

Metadata (:class:`KdaMeta`): tokens, layers, the layer kinds (``linear`` / ``full``), the
latent's widths, the indexer layers and key width, the KDA heads, head dim and conv
kernel, ``dtype``, ``page_size`` and the model fingerprint. Flattened (a transport's
region) the tensors follow one another layer by layer in the order above
(graphcp.pd.layout); an MLA layer's rows may travel in runs of positions, a KDA layer's
states only whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from graphcp.config import DTYPES, parse_dtype
from graphcp.model.hybrid.export import FULL, LINEAR
from graphcp.pd.export import KVFormatError, LayerTensorsExport
from graphcp.pd.layout import TensorLayout

KDA_FORMAT = "graphcp-kda/1"
_POSITIVE = ("num_tokens", "num_layers", "kv_lora_rank", "num_heads", "head_dim", "conv_kernel", "page_size")
_INTS = (*_POSITIVE, "rope_dim", "index_dim")


@dataclass(frozen=True)
class KdaMeta(TensorLayout):
    num_tokens: int
    num_layers: int
    layer_kinds: tuple[str, ...]  # linear | full per layer
    kv_lora_rank: int
    rope_dim: int  # 0: no rope slice (no rope_key tensor)
    index_dim: int  # the pooled indexer's key width (0: no indexer)
    index_layers: tuple[int, ...]  # the MLA layers that run the indexer (they alone have index_key / index_gate)
    num_heads: int
    head_dim: int
    conv_kernel: int
    dtype: str
    page_size: int
    fingerprint: str
    family: str = "kimi_linear"
    format: str = KDA_FORMAT

    #: the format's name (a subclass's own: GLM-5-Next's)
    FORMAT: ClassVar[str] = KDA_FORMAT
    token_dim = 0

    def __post_init__(self) -> None:
        what = f"{self.FORMAT} metadata"
        for name in _INTS:
            v, lo = getattr(self, name), 1 if name in _POSITIVE else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise KVFormatError(f"{what}: {name} must be an integer >= {lo}, got {v!r}")
        if self.dtype not in DTYPES:
            raise KVFormatError(f"{what}: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if len(self.layer_kinds) != self.num_layers or set(self.layer_kinds) - {LINEAR, FULL}:
            raise KVFormatError(f"{what}: layer_kinds must be {self.num_layers} of linear / full, got "
                                f"{list(self.layer_kinds)}")
        full = [i for i, k in enumerate(self.layer_kinds) if k == FULL]
        if list(self.index_layers) != sorted(set(self.index_layers)) or set(self.index_layers) - set(full) or (
                self.index_layers and not self.index_dim):
            raise KVFormatError(f"{what}: index_layers must be increasing full layers (with index_dim > 0), got "
                                f"{list(self.index_layers)}")
        if self.format != self.FORMAT:
            raise KVFormatError(f"{what}: format {self.format!r} is not {self.FORMAT!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def conv_dim(self) -> int:
        return 3 * self.num_heads * self.head_dim

    def layer_tensors(self, layer: int) -> tuple[str, ...]:
        if self.layer_kinds[layer] == LINEAR:
            return ("conv", "recurrent")
        return (("latent",) + (("rope_key",) if self.rope_dim else ())
                + (("index_key", "index_gate") if layer in self.index_layers else ()))

    def tensor_dtype(self, layer: int, name: str) -> torch.dtype:
        return torch.float32 if name == "recurrent" else self.torch_dtype

    def tensor_shape(self, layer: int, name: str, num_tokens: int | None = None) -> tuple[int, ...]:
        T = self.num_tokens if num_tokens is None else num_tokens
        if name == "conv":
            return (self.conv_dim, self.conv_kernel)
        if name == "recurrent":
            return (self.num_heads, self.head_dim, self.head_dim)
        width = {"latent": self.kv_lora_rank, "rope_key": self.rope_dim, "index_key": self.index_dim,
                 "index_gate": self.index_dim}[name]
        return (T, width)

    def span_runs(self, layer: int, name: str, start: int, num_tokens: int) -> list[tuple[int, int, int]]:
        if self.layer_kinds[layer] == FULL:
            return super().span_runs(layer, name, start, num_tokens)
        if (start, num_tokens) != (0, self.num_tokens):
            raise KVFormatError(f"{self.FORMAT}: KDA layer {layer}'s states travel whole (positions 0.."
                                f"{self.num_tokens}), got positions {start}..{start + num_tokens}")
        return [(0, self.tensor_offset(layer, name), self.nbytes_of(layer, name))]

    def make_export(self, layers: list[dict[str, torch.Tensor]], **extra) -> "KdaExport":
        return KdaExport(self, layers, **extra)

    def to_dict(self) -> dict[str, str]:
        """String values (a safetensors header holds strings only)."""
        d = {k: str(v) for k, v in vars(self).items()}
        d["layer_kinds"] = ",".join(self.layer_kinds)
        d["index_layers"] = ",".join(map(str, self.index_layers))
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> "KdaMeta":
        source = source or f"{cls.FORMAT} metadata"
        missing = [k for k in (*_INTS, "layer_kinds", "index_layers", "dtype", "fingerprint", "format") if k not in d]
        if missing:
            raise KVFormatError(f"{source}: missing KDA KV metadata {missing} (not a {cls.FORMAT} export?)")
        try:
            ints = {k: int(d[k]) for k in _INTS}
            index = tuple(int(x) for x in str(d["index_layers"]).split(",") if x != "")
        except (TypeError, ValueError):
            raise KVFormatError(f"{source}: {', '.join(_INTS)} and index_layers must be integers, got "
                                f"{ {k: d[k] for k in (*_INTS, 'index_layers')} }") from None
        kinds = tuple(k for k in str(d["layer_kinds"]).split(",") if k)
        try:
            return cls(**ints, layer_kinds=kinds, index_layers=index, dtype=str(d["dtype"]),
                       fingerprint=str(d["fingerprint"]), family=str(d.get("family", "")), format=str(d["format"]))
        except KVFormatError as e:
            raise KVFormatError(f"{source}: {e}") from None


@dataclass
class KdaExport(LayerTensorsExport):
    """One request's KDA hybrid cache (module docstring): ``layers[i]`` maps the layer's
    tensor names to tensors. ``token_ids`` and ``last_logits`` ride along as in
    :class:`graphcp.pd.export.KVExport`."""

    meta: KdaMeta
    SOURCE = "KDA KV export"


def kda_meta(meta_class: type[KdaMeta], cfg, kda, latent, index_dim: int, index_layers: tuple[int, ...],
             num_tokens: int, runtime, fingerprint: str) -> KdaMeta:
    """The export metadata of one request of a KDA hybrid (``cfg``: its ModelConfig)."""
    return meta_class(num_tokens, cfg.num_layers, kda.layer_kinds, latent.kv_lora_rank, latent.qk_rope_head_dim,
                      index_dim, index_layers, kda.num_heads, kda.head_dim, kda.conv_kernel, runtime.dtype,
                      runtime.page_size, fingerprint, cfg.family, meta_class.FORMAT)
