"""MlaExport: one request's cache of a DSA model (DeepSeek V3.2, GLM-5), format ``graphcp-mla/1``.

Per layer ``i`` (over all the request's tokens, cached prefix + new, the model dtype,
contiguous), what a decode engine of these models keeps:

- ``latent.<i>`` ``[T, kv_lora_rank]``: ``kv_a_layernorm`` of the compressed KV
  (transformers' ``cache.layers[i].keys[0, 0]``);
- ``rope_key.<i>`` ``[T, qk_rope_head_dim]``: the shared rope key **after RoPE, pairs
  interleaved in place** as graphcp caches them (and DeepSeek's inference code): values
  ``(x0', x1', x2', x3', ...)`` where ``(x0', x1')`` is the pair ``(x0, x1)`` rotated by
  frequency 0, ``(x2', x3')`` by frequency 1, ... transformers' cache
  (``cache.layers[i].values[0, 0]``) lists the pairs' first members, then the second
  ones: ``torch.cat([rope_key[:, 0::2], rope_key[:, 1::2]], -1)``
  (:func:`interleaved_to_half_split`); back: ``torch.stack([hf[:, :d/2], hf[:, d/2:]],
  -1).flatten(-2)`` (:func:`half_split_to_interleaved`);
- ``index_key.<i>`` ``[T, index_head_dim]``, only for the layers that run the indexer
  (``MlaMeta.index_layers``; a GLM "shared" layer reuses an earlier selection): the
  indexer key after LayerNorm and RoPE on its first ``qk_rope_head_dim`` dims. DeepSeek
  V3.2 rotates them half-split (transformers' order already); GLM-5 interleaves them
  (``MlaMeta.index_rope_interleaved``): the same permutation of those first dims as
  the rope key, the rest as is (transformers' ``cache.layers[i].indexer_keys[0]``).

Metadata (:class:`MlaMeta`): tokens, layers, ``kv_lora_rank``, ``rope_dim``,
``index_dim``, ``index_layers``, ``index_rope_interleaved``, ``family``, ``dtype``,
the prefill engine's ``page_size`` and the model fingerprint. Flattened (a transport's
region) the tensors follow one another: layer 0's ``latent``, ``rope_key``,
(``index_key``), layer 1's, ... (graphcp.pd.layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.config import DTYPES, parse_dtype
from graphcp.pd.export import KVFormatError, check_tensors
from graphcp.pd.layout import TensorLayout

MLA_FORMAT = "graphcp-mla/1"
_INTS = ("num_tokens", "num_layers", "kv_lora_rank", "rope_dim", "index_dim", "page_size")


@dataclass(frozen=True)
class MlaMeta(TensorLayout):
    num_tokens: int
    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    index_dim: int
    index_layers: tuple[int, ...]  # the layers that run the indexer (they alone have index_key)
    index_rope_interleaved: bool  # GLM-5: the indexer key's rope dims are interleaved pairs too
    family: str  # deepseek_v32 | glm_moe_dsa
    dtype: str
    page_size: int
    fingerprint: str
    format: str = MLA_FORMAT

    token_dim = 0

    def __post_init__(self) -> None:
        for name in _INTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KVFormatError(f"MLA KV metadata: {name} must be an integer >= 1, got {v!r}")
        if self.dtype not in DTYPES:
            raise KVFormatError(f"MLA KV metadata: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        bad = [i for i in self.index_layers if not 0 <= i < self.num_layers]
        if bad or list(self.index_layers) != sorted(set(self.index_layers)):
            raise KVFormatError(f"MLA KV metadata: index_layers must be increasing layers of 0..{self.num_layers - 1}, "
                                f"got {list(self.index_layers)}")
        if self.format != MLA_FORMAT:
            raise KVFormatError(f"MLA KV metadata: format {self.format!r} is not {MLA_FORMAT!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def layer_tensors(self, layer: int) -> tuple[str, ...]:
        return ("latent", "rope_key", "index_key") if layer in self.index_layers else ("latent", "rope_key")

    def tensor_shape(self, layer: int, name: str, num_tokens: int | None = None) -> tuple[int, ...]:
        width = {"latent": self.kv_lora_rank, "rope_key": self.rope_dim, "index_key": self.index_dim}[name]
        return (self.num_tokens if num_tokens is None else num_tokens, width)

    def make_export(self, layers: list[dict[str, torch.Tensor]], **extra) -> "MlaExport":
        return MlaExport(self, layers, **extra)

    def to_dict(self) -> dict[str, str]:
        """String values (a safetensors header holds strings only)."""
        d = {k: str(v) for k, v in vars(self).items()}
        d["index_layers"] = ",".join(map(str, self.index_layers))
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "MLA KV metadata") -> "MlaMeta":
        missing = [k for k in (*_INTS, "index_layers", "index_rope_interleaved", "family", "dtype", "fingerprint",
                               "format") if k not in d]
        if missing:
            raise KVFormatError(f"{source}: missing MLA KV metadata {missing} (not a {MLA_FORMAT} export?)")
        try:
            ints = {k: int(d[k]) for k in _INTS}
            index = tuple(int(x) for x in str(d["index_layers"]).split(",") if x != "")
        except (TypeError, ValueError):
            raise KVFormatError(f"{source}: {', '.join(_INTS)} and index_layers must be integers, got "
                                f"{ {k: d[k] for k in (*_INTS, 'index_layers')} }") from None
        if str(d["index_rope_interleaved"]) not in ("True", "False"):
            raise KVFormatError(f"{source}: index_rope_interleaved must be True or False, got "
                                f"{d['index_rope_interleaved']!r}")
        try:
            return cls(**ints, index_layers=index, index_rope_interleaved=str(d["index_rope_interleaved"]) == "True",
                       family=str(d["family"]), dtype=str(d["dtype"]), fingerprint=str(d["fingerprint"]),
                       format=str(d["format"]))
        except KVFormatError as e:
            raise KVFormatError(f"{source}: {e}") from None


def interleaved_to_half_split(x: torch.Tensor, dims: int | None = None) -> torch.Tensor:
    """The first ``dims`` (default: all) values of each row from interleaved pairs
    ``(a0, b0, a1, b1, ...)`` to transformers' order ``(a0, a1, ..., b0, b1, ...)``; the rest as is."""
    d = x.shape[-1] if dims is None else dims
    return torch.cat([x[..., :d:2], x[..., 1:d:2], x[..., d:]], dim=-1)


def half_split_to_interleaved(x: torch.Tensor, dims: int | None = None) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_half_split`."""
    d = x.shape[-1] if dims is None else dims
    pairs = torch.stack([x[..., : d // 2], x[..., d // 2:d]], dim=-1).flatten(-2)
    return torch.cat([pairs, x[..., d:]], dim=-1)


def mla_meta(cfg, num_tokens: int, dtype: str, page_size: int, fingerprint: str) -> MlaMeta:
    """The export metadata of a DSA model's request (``cfg``: its graphcp ModelConfig)."""
    d = cfg.dsa
    return MlaMeta(num_tokens, cfg.num_layers, d.kv_lora_rank, d.qk_rope_head_dim, d.index_head_dim,
                   tuple(i for i, full in enumerate(d.indexer_layers) if full), d.indexer_rope_interleaved,
                   cfg.family, dtype, page_size, fingerprint)


@dataclass
class MlaExport:
    """One request's DSA cache (module docstring): ``layers[i]`` maps ``latent``,
    ``rope_key`` and (indexer layers) ``index_key`` to tensors. ``token_ids`` and
    ``last_logits`` ride along as in :class:`graphcp.pd.export.KVExport`."""

    meta: MlaMeta
    layers: list[dict[str, torch.Tensor]]
    token_ids: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        return self.layers[layer][name]

    def check(self, source: str = "MLA KV export") -> "MlaExport":
        """KVFormatError unless every layer has the metadata's tensors, shapes and dtype."""
        m = self.meta
        if len(self.layers) != m.num_layers:
            raise KVFormatError(f"{source}: {len(self.layers)} layers of tensors for {m.num_layers} layers")
        for i, ts in enumerate(self.layers):
            if set(ts) != set(m.layer_tensors(i)):
                raise KVFormatError(f"{source}: layer {i} has {sorted(ts)}, expected {sorted(m.layer_tensors(i))}")
        return check_tensors(self, source)

    def to(self, device: torch.device | str) -> "MlaExport":
        return MlaExport(self.meta, [{n: t.to(device) for n, t in ts.items()} for ts in self.layers],
                         self.token_ids, self.last_logits)
