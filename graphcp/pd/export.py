"""KVExport: one request's KV in graphcp's transport-neutral layout.

Layout (format ``graphcp-kv/1``): for every layer ``i`` of the model, ``k[i]`` and
``v[i]`` of shape ``[num_kv_heads, num_tokens, head_dim]`` in the model dtype,
contiguous, over all the request's tokens (cached prefix + new), keys **after RoPE**
(what transformers' cache holds: a decode engine appends to it as it is). Metadata
(:class:`KVMeta`): token count, layer count, heads, head_dim, dtype, the prefill
engine's page size and the model fingerprint (graphcp.model.fingerprint).

Flattened for a transport (the Mooncake receiver's buffer, see graphcp.pd.mooncake)
the request is one region: layer 0's K, layer 0's V, layer 1's K, ..., so tensor
``(layer, kind)`` starts at byte ``(2 * layer + kind) * H * T * D * itemsize`` and
head ``h``'s run of positions ``[s, e)`` at ``... + (h * T + s) * D * itemsize``.

Assembly (:func:`assemble`) reads the pieces each rank holds (graphcp.kv.spans) and
puts them in order into the export's own tensors: only that request's KV moves,
never a pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from graphcp.config import DTYPES, parse_dtype
from graphcp.dist import CPGroup
from graphcp.errors import InputError
from graphcp.kv.spans import KVSource, KVSpan
from graphcp.pd.layout import TensorLayout

FORMAT = "graphcp-kv/1"


class KVFormatError(InputError):
    """A KV export (file, header or message) that does not follow graphcp-kv/1."""


@dataclass(frozen=True)
class KVMeta(TensorLayout):
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16 | float16
    page_size: int  # the prefill engine's (informational: the layout has no pages)
    fingerprint: str  # the model's (graphcp.model.fingerprint)
    format: str = FORMAT
    #: the last ``draft_layers`` of the ``num_layers`` are a speculative draft's (an EAGLE-3
    #: draft's one layer, docs/speculative.md); the target's are the first ones
    draft_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_layers", "num_kv_heads", "head_dim", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KVFormatError(f"KV metadata: {name} must be an integer >= 1, got {v!r}")
        d = self.draft_layers
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < self.num_layers:
            raise KVFormatError(f"KV metadata: draft_layers must be an integer in [0, num_layers={self.num_layers}), "
                                f"got {d!r}")
        if self.dtype not in DTYPES:
            raise KVFormatError(f"KV metadata: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.format != FORMAT:
            raise KVFormatError(f"KV metadata: format {self.format!r} is not {FORMAT!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def target_layers(self) -> int:
        """The target model's layers (the draft's follow them)."""
        return self.num_layers - self.draft_layers

    @property
    def shape(self) -> tuple[int, int, int]:
        """Every k and v tensor's shape."""
        return (self.num_kv_heads, self.num_tokens, self.head_dim)

    token_dim = 1  # [heads, tokens, head_dim]

    def layer_tensors(self, layer: int) -> tuple[str, ...]:
        return ("k", "v")

    def tensor_shape(self, layer: int, name: str, num_tokens: int | None = None) -> tuple[int, ...]:
        return (self.num_kv_heads, self.num_tokens if num_tokens is None else num_tokens, self.head_dim)

    def make_export(self, layers: list[dict[str, torch.Tensor]], **extra) -> "KVExport":
        return KVExport(self, [t["k"] for t in layers], [t["v"] for t in layers], **extra)

    def head_shard(self, size: int) -> "KVMeta":
        """One attention-TP rank's share: its KV heads (one, replicated, when the model has
        fewer than the ranks; graphcp.model.heads)."""
        return replace(self, num_kv_heads=self.num_kv_heads // size if self.num_kv_heads >= size else 1)

    def merge_heads(self, layer: int, name: str, gathered: torch.Tensor, size: int) -> torch.Tensor:
        """The whole ``[num_kv_heads, tokens, head_dim]`` from the attention-TP ranks'
        shares all-gathered rank-major (a KV head replicated over ranks kept once)."""
        H = self.num_kv_heads
        return (gathered if gathered.shape[0] == H else gathered[:: size // H]).contiguous()

    def take_heads(self, layer: int, name: str, whole: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        """Attention-TP rank ``rank``'s KV heads of ``whole`` ``[num_kv_heads, tokens,
        head_dim]`` (graphcp.model.heads: an even share, or the one head its query heads
        read when the model has fewer KV heads than ranks)."""
        return take_kv_heads(whole, self.num_kv_heads, size, rank)

    @property
    def tensor_bytes(self) -> int:
        return self.num_kv_heads * self.num_tokens * self.head_dim * self.torch_dtype.itemsize

    @property
    def nbytes(self) -> int:
        """The whole request: 2 tensors a layer."""
        return 2 * self.num_layers * self.tensor_bytes

    def offset(self, layer: int, kind: int, head: int = 0, position: int = 0) -> int:
        """Byte offset of ``(layer, kind (0 = K, 1 = V), head, position)`` in the flat layout."""
        row = head * self.num_tokens + position
        return (2 * layer + kind) * self.tensor_bytes + row * self.head_dim * self.torch_dtype.itemsize

    def to_dict(self) -> dict[str, str]:
        """String values (a safetensors header holds strings only)."""
        # (draft_layers only when a draft's layers ride along: other exports keep their header)
        return {k: str(v) for k, v in vars(self).items() if k != "draft_layers" or v}

    @classmethod
    def from_dict(cls, d: dict, source: str = "KV metadata") -> "KVMeta":
        if not isinstance(d, dict):
            raise KVFormatError(f"{source}: expected a mapping of metadata, got {type(d).__name__}")
        missing = [k for k in ("num_tokens", "num_layers", "num_kv_heads", "head_dim", "dtype", "page_size",
                               "fingerprint", "format") if k not in d]
        if missing:
            raise KVFormatError(f"{source}: missing KV metadata {missing} (not a {FORMAT} export?)")
        ints = {}
        for k in ("num_tokens", "num_layers", "num_kv_heads", "head_dim", "page_size", "draft_layers"):
            if k not in d:  # draft_layers: optional (0)
                continue
            try:
                ints[k] = int(d[k])
            except (TypeError, ValueError):
                raise KVFormatError(f"{source}: {k} must be an integer, got {d[k]!r}") from None
        try:
            return cls(**ints, dtype=str(d["dtype"]), fingerprint=str(d["fingerprint"]), format=str(d["format"]))
        except KVFormatError as e:
            raise KVFormatError(f"{source}: {e}") from None


def take_kv_heads(whole: torch.Tensor, num_kv_heads: int, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s KV heads of ``whole`` (heads along dim 0), as
    graphcp.model.heads.head_shard gives them (the inverse of ``KVMeta.merge_heads``)."""
    if num_kv_heads >= size:
        n = num_kv_heads // size
        return whole[rank * n:(rank + 1) * n]
    first = rank * num_kv_heads // size
    return whole[first:first + 1]


@dataclass
class KVExport:
    """One request's KV (module docstring). ``token_ids`` (int64 [num_tokens]) and
    ``last_logits`` (float32 [vocab], the first token's logits) ride along when the
    caller knows them (the command line's exports carry both)."""

    meta: KVMeta
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    token_ids: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None

    def check(self, source: str = "KV export") -> "KVExport":
        """KVFormatError unless every tensor has the metadata's shape and dtype."""
        m = self.meta
        if len(self.k) != m.num_layers or len(self.v) != m.num_layers:
            raise KVFormatError(f"{source}: {len(self.k)} K and {len(self.v)} V tensors for {m.num_layers} layers")
        return check_tensors(self, source)

    def to(self, device: torch.device | str) -> "KVExport":
        return KVExport(self.meta, [t.to(device) for t in self.k], [t.to(device) for t in self.v],
                        self.token_ids, self.last_logits)

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        """Tensor ``name`` (``k`` or ``v``) of ``layer`` (the formats' common accessor)."""
        return getattr(self, name)[layer]


def check_tensors(export, source: str):
    """KVFormatError unless every tensor of ``export`` (either format: its ``meta``'s
    ``tensors()``, read through ``export.tensor``) has the metadata's shape and dtype,
    and ``token_ids`` (when present) one id a token; returns ``export``."""
    m = export.meta
    for i, n in m.tensors():
        t, want, dtype = export.tensor(i, n), m.tensor_shape(i, n), m.tensor_dtype(i, n)
        if tuple(t.shape) != want or t.dtype != dtype:
            raise KVFormatError(f"{source}: {n}.{i} is {tuple(t.shape)} {t.dtype}, expected {want} {dtype}")
    ids = export.token_ids
    if ids is not None and tuple(ids.shape) != (m.num_tokens,):
        raise KVFormatError(f"{source}: token_ids has shape {tuple(ids.shape)}, expected ({m.num_tokens},)")
    return export


@dataclass
class LayerTensorsExport:
    """One request's cache in a format whose layers hold named tensors of their own kinds
    (a family's own format: window rows and compressor state, K/V beside recurrent state):
    ``layers[i]`` maps the layer's tensor names to tensors, as ``meta.layer_tensors(i)``
    names them. ``token_ids`` and ``last_logits`` ride along as in :class:`KVExport`."""

    meta: TensorLayout
    layers: list[dict[str, torch.Tensor]]
    token_ids: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None
    #: what an error names this export when the caller does not
    SOURCE = "KV export"

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        return self.layers[layer][name]

    def check(self, source: str | None = None):
        """KVFormatError unless every layer has the metadata's tensors, shapes and dtypes."""
        m, source = self.meta, source or self.SOURCE
        if len(self.layers) != m.num_layers:
            raise KVFormatError(f"{source}: {len(self.layers)} layers of tensors for {m.num_layers} layers")
        for i, ts in enumerate(self.layers):
            if set(ts) != set(m.layer_tensors(i)):
                raise KVFormatError(f"{source}: layer {i} ({m.layer_kinds[i]}) has {sorted(ts)}, expected "
                                    f"{sorted(m.layer_tensors(i))}")
        return check_tensors(self, source)

    def to(self, device: torch.device | str):
        return type(self)(self.meta, [{n: t.to(device) for n, t in ts.items()} for ts in self.layers],
                          self.token_ids, self.last_logits)


def assemble(source: KVSource, handle, spans: list[KVSpan], group: CPGroup, meta, dst: int | None,
             device: torch.device) -> list[dict[str, torch.Tensor]] | None:
    """Put one request's KV together from the spans each rank holds, in ``meta``'s format
    (a :class:`KVMeta` or any :class:`TensorLayout` with ``make_export``: a family's
    own format, graphcp.pd.formats, whose spans may be whole layers):
    its tensors, per layer by name, on the receiving ranks (``meta.make_export`` makes
    the export of them), None on the others. Every rank
    calls it (the same spans everywhere). ``dst``: the rank that receives, or None for
    every rank. Every layer of ``meta`` is allocated and the spans' layers are filled
    (under pipeline stages, the stage's own layers: :func:`gather_stages` fills the rest).
    A span every receiving rank holds is read locally (a replicated cache: no traffic);
    the others come from their owners, each owner packing all its spans into one
    message: a point-to-point send to ``dst``, or a broadcast when every rank receives.
    At most C - 1 messages a request (not one per span: a token-sharded cache has 2C
    runs a layer per chunk)."""
    me = group.rank
    receivers = range(group.size) if dst is None else (dst,)
    receive = me in receivers
    out = [{n: torch.empty(meta.tensor_shape(i, n), dtype=meta.tensor_dtype(i, n), device=device)
            for n in meta.layer_tensors(i)} for i in range(meta.num_layers)] if receive else None
    remote: dict[int, list[KVSpan]] = {}
    for span in spans:
        if all(source.holds(span, r) for r in receivers):
            if receive:
                _place(out, span, source.read_span(handle, span), meta)
        else:
            remote.setdefault(span.owner, []).append(span)
    for owner, theirs in sorted(remote.items()):
        if me == owner:
            buf = _as_bytes([t for s in theirs for t in source.read_span(handle, s)])
        elif dst is None or me == dst:
            nbytes = sum(meta.nbytes_of(s.layer, n, s.num_tokens) for s in theirs for n in meta.layer_tensors(s.layer))
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            continue  # neither the owner nor the receiver of this part
        if dst is None:
            group.broadcast_(buf, owner)
        elif me == owner:
            group.send(buf, dst)
            continue
        else:
            group.recv_(buf, owner)
        _unpack(out, theirs, buf, meta)
    return out if receive else None


def gather_stages(out: list[dict[str, torch.Tensor]] | None, meta, stage_layers: list[range], stage: int,
                  world: CPGroup, stage_size: int, dst: int | None, device: torch.device) -> None:
    """Under pipeline stages: each stage has assembled its own layers (at every rank when
    ``dst`` is None, else at the rank of the stage in ``dst``'s place: stage-local rank
    ``dst % stage_size``); move every stage's layers to the final receivers over
    ``world`` (every rank of the pipeline, stage-major: global rank ``s * stage_size +
    r``). One message a stage: a broadcast from the stage's first rank when every rank
    receives, else a send from rank ``(s, dst % stage_size)`` to ``dst``. Every rank
    calls it."""
    for s, layers in enumerate(stage_layers):
        nbytes = sum(meta.nbytes_of(i, n, meta.num_tokens) for i in layers for n in meta.layer_tensors(i))
        if dst is None:
            root = s * stage_size
            if stage == s and world.rank == root:
                buf = _pack(out, layers, meta)
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            world.broadcast_(buf, root)
            if stage != s:
                _unpack_layers(out, layers, buf, meta)
            continue
        dst_stage, place = divmod(dst, stage_size)
        src = s * stage_size + place
        if s == dst_stage:
            continue  # dst assembled its own stage's layers
        if world.rank == src:
            world.send(_pack(out, layers, meta), dst)
        elif world.rank == dst:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            world.recv_(buf, src)
            _unpack_layers(out, layers, buf, meta)


def send_export(out: list[dict[str, torch.Tensor]] | None, meta, world: CPGroup, src: int, dst: int | None,
                device: torch.device) -> list[dict[str, torch.Tensor]] | None:
    """A whole export that rank ``src`` of ``world`` holds (``out``) to rank ``dst``, or to
    every rank (``dst`` None), in one message (a send, or a broadcast); what this rank
    holds after (None where it receives nothing). Every rank calls it."""
    if dst == src:
        return out if world.rank == src else None
    layers = range(meta.num_layers)
    nbytes = sum(meta.nbytes_of(i, n) for i, n in meta.tensors())
    if world.rank == src:
        buf = _pack(out, layers, meta)
        if dst is None:
            world.broadcast_(buf, src)
        else:
            world.send(buf, dst)
        return out if dst is None else None
    if dst is not None and world.rank != dst:
        return None
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if dst is None:
        world.broadcast_(buf, src)
    else:
        world.recv_(buf, src)
    got = [{n: torch.empty(meta.tensor_shape(i, n), dtype=meta.tensor_dtype(i, n), device=device)
            for n in meta.layer_tensors(i)} for i in layers]
    _unpack_layers(got, layers, buf, meta)
    return got


def _as_bytes(tensors) -> torch.Tensor:
    """Tensors flattened into one byte message, in order (each keeps its own dtype's bytes:
    a format may mix dtypes, float32 gates beside model-dtype rows)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _pack(out: list[dict[str, torch.Tensor]], layers: range, meta) -> torch.Tensor:
    """Whole layers' tensors, in layer then tensor order, as one byte message."""
    return _as_bytes(out[i][n] for i in layers for n in meta.layer_tensors(i))


def _unpack_layers(out: list[dict[str, torch.Tensor]], layers: range, buf: torch.Tensor, meta) -> None:
    _unpack(out, [KVSpan(i, 0, meta.num_tokens, -1) for i in layers], buf, meta)


def _unpack(out: list[dict[str, torch.Tensor]], spans: list[KVSpan], buf: torch.Tensor, meta) -> None:
    """Place an owner's packed spans (each span's tensors in order, as bytes) into the export."""
    at = 0
    for span in spans:
        parts = []
        for n in meta.layer_tensors(span.layer):
            shape = meta.tensor_shape(span.layer, n, span.num_tokens)
            size = meta.nbytes_of(span.layer, n, span.num_tokens)
            # (a copy: a tensor's offset in a message of mixed dtypes need not be aligned to its dtype)
            parts.append(buf[at:at + size].clone().view(meta.tensor_dtype(span.layer, n)).view(shape))
            at += size
        _place(out, span, parts, meta)


def _place(out: list[dict[str, torch.Tensor]], span: KVSpan, parts, meta) -> None:
    whole = (span.start, span.num_tokens) == (0, meta.num_tokens)  # (a layer's rows need not be one a token)
    for n, t in zip(meta.layer_tensors(span.layer), parts):
        dst = out[span.layer][n]
        (dst if whole else dst.narrow(meta.token_dim, span.start, span.num_tokens)).copy_(t)
