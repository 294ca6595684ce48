"""The attention contract: :class:`Attention`, the one type of the attention a forward
runs (every seam names it), of two kinds: an :class:`AttentionBackend` over paged K/V
heads, which the KV exchange calls, and a family's own attention over its cache (a
sparse attention, which the family's layers call in the attention break).

A backend attends a rank's query rows over the paged KV cache, one *segment* at a
time. A segment is a contiguous run of query rows (local order) that attends one
request's KV with bottom-right causal alignment: row ``i`` of a segment of
``q_len`` rows sees cache positions ``< kv_len - q_len + i + 1``.

Metadata is explicit per forward (:class:`AttentionMetadata`), never global.
Rows of ``q`` past ``cu_seqlens_q[-1]`` are padding: a backend must not write
their output or LSE rows.

LSE is the natural-log (base e) log-sum-exp of the scaled scores of each query
row and head. Backends whose kernels return base-2 LSE convert before writing.

*Non-causal* metadata (``causal=False``: the steps of a ring over a sharded cache,
where a block of keys lies wholly before or after a block of queries) drops the
mask: every row of a segment sees all ``kv_len`` keys. There ``kv_len`` may be
smaller than ``q_len``, or 0: rows that see no key get output 0 and LSE -inf
(what an LSE merge skips). Non-causal metadata is always live (never static).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphcp.attention.staging import to_device
from graphcp.kv.layout import KVLayout

LSE_BASE = "e"


class AttentionMetadata:
    """Segments of one rank's query rows for one forward.

    The host arrays (int32) are what host-side planners and the torch reference
    read; the device tensors (int32, on the model's device) are what kernels read.
    The device tensors are made on first use, from one packed host buffer in a
    single transfer, so a forward whose backend reads only the host side pays
    nothing for them. ``page_table[s, p]`` is the cache page holding positions
    ``[p * page_size, (p + 1) * page_size)`` of segment ``s``'s request; entries
    past the request's pages are 0 (the scratch page) and never read. Read-only.

    *Static* metadata (:attr:`static`) is built over caller-owned device tensors,
    the static buffers of a full graph: a forward's batch is copied into them
    before each replay, so the host arrays are only bounds (``max_q_len`` is the
    bucket's row capacity) and say nothing about the rows a replay will have.
    """

    __slots__ = ("cu_seqlens_q_host", "kv_lens_host", "page_table_host", "page_size", "max_q_len", "max_kv_len",
                 "device", "_packed", "_tensors", "static", "causal")

    cu_seqlens_q_host: np.ndarray  # int32 [S + 1]
    kv_lens_host: np.ndarray  # int32 [S]
    page_table_host: np.ndarray  # int32 [S, max_pages]
    page_size: int
    max_q_len: int
    max_kv_len: int
    device: torch.device
    #: bottom-right causal segments (True), or every row sees all its segment's keys
    causal: bool

    def __init__(
        self,
        cu_seqlens_q_host: np.ndarray,
        kv_lens_host: np.ndarray,
        page_table_host: np.ndarray,
        page_size: int,
        max_q_len: int,
        max_kv_len: int,
        device: torch.device | str = "cpu",
        device_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        _packed: np.ndarray | None = None,
        causal: bool = True,
    ) -> None:
        """Use :meth:`from_host`; this constructor takes ready int32 host arrays and,
        optionally, the device tensors (static graph buffers, say) to report."""
        set_ = object.__setattr__
        set_(self, "cu_seqlens_q_host", cu_seqlens_q_host)
        set_(self, "kv_lens_host", kv_lens_host)
        set_(self, "page_table_host", page_table_host)
        set_(self, "page_size", page_size)
        set_(self, "max_q_len", max_q_len)
        set_(self, "max_kv_len", max_kv_len)
        set_(self, "device", device)
        set_(self, "_packed", _packed)
        set_(self, "_tensors", device_tensors)
        # device tensors handed in are static graph buffers, refilled before every replay
        set_(self, "static", device_tensors is not None)
        if not causal and device_tensors is not None:
            raise ValueError("non-causal metadata (ring steps) is live metadata, never static graph buffers")
        set_(self, "causal", bool(causal))

    @classmethod
    def _live(cls, cu_seqlens_q_host: np.ndarray, kv_lens_host: np.ndarray, page_table_host: np.ndarray,
              page_size: int, max_q_len: int, max_kv_len: int, device: torch.device | str, _packed: np.ndarray,
              causal: bool = True) -> AttentionMetadata:
        """The constructor's result for live metadata (no device tensors handed in) of
        one packed buffer, ``causal`` a bool: the per-forward path (planners build one
        to eight a forward), through the slots' setters (half the constructor's cost)."""
        self = _new_object(cls)
        _SET_CU(self, cu_seqlens_q_host)
        _SET_KV(self, kv_lens_host)
        _SET_PT(self, page_table_host)
        _SET_PS(self, page_size)
        _SET_MQ(self, max_q_len)
        _SET_MK(self, max_kv_len)
        _SET_DEV(self, device)
        _SET_PACKED(self, _packed)
        _SET_TENSORS(self, None)
        _SET_STATIC(self, False)
        _SET_CAUSAL(self, causal)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"AttentionMetadata is read-only; cannot set {name!r}")

    def _device_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self._tensors
        if t is None:
            s, width = self.page_table_host.shape
            packed = self._packed
            if packed is None:
                packed = np.concatenate([self.cu_seqlens_q_host, self.kv_lens_host, self.page_table_host.reshape(-1)])
            buf = to_device(packed, self.device)  # one upload a metadata, not blocking the host
            t = (buf[: s + 1], buf[s + 1 : 2 * s + 1], buf[2 * s + 1 :].view(s, width))
            object.__setattr__(self, "_tensors", t)
        return t

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """int32 [S + 1] on the device."""
        return self._device_tensors()[0]

    @property
    def kv_lens(self) -> torch.Tensor:
        """int32 [S] on the device."""
        return self._device_tensors()[1]

    @property
    def page_table(self) -> torch.Tensor:
        """int32 [S, max_pages] on the device."""
        return self._device_tensors()[2]

    @property
    def num_segments(self) -> int:
        return int(self.kv_lens_host.shape[0])

    @property
    def num_q_rows(self) -> int:
        """Rows that belong to a segment; rows of ``q`` past this are padding."""
        return int(self.cu_seqlens_q_host[-1])

    @property
    def kernel_rows(self) -> int:
        """The query rows a kernel call covers: the live rows, or for static metadata
        (a full graph, planned before it is filled) the bucket's bound."""
        return self.max_q_len if self.static else self.num_q_rows

    @property
    def q_lens_host(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_q_host)

    def __repr__(self) -> str:
        return (f"AttentionMetadata(num_segments={self.num_segments}, num_q_rows={self.num_q_rows}, "
                f"max_q_len={self.max_q_len}, max_kv_len={self.max_kv_len}, page_size={self.page_size}"
                f"{', static' if self.static else ''}{'' if self.causal else ', non-causal'})")

    def no_key_rows(self) -> np.ndarray:
        """int64: the rows of non-empty segments with ``kv_len == 0`` (non-causal
        metadata only; causal segments have ``q_len <= kv_len``): a kernel that needs a
        key per segment gets one inert key for them, and the backend then writes these
        rows' contract values (output 0, LSE -inf)."""
        q_lens = self.q_lens_host
        empty = np.flatnonzero((q_lens > 0) & (self.kv_lens_host == 0))
        if empty.size == 0:
            return empty.astype(np.int64)
        starts = self.cu_seqlens_q_host[:-1][empty].astype(np.int64)
        lens = q_lens[empty].astype(np.int64)
        return np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))

    @staticmethod
    def host_buffers(num_segments: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A packed int32 buffer and its cu_seqlens_q [S + 1], kv_lens [S] and page
        table [S, width] views, for a caller that writes them in place and then passes
        the views and ``_packed=buffer`` to the constructor (the engine's hot path)."""
        s = num_segments
        buf = np.empty(2 * s + 1 + s * width, dtype=np.int32)
        return buf, buf[: s + 1], buf[s + 1 : 2 * s + 1], buf[2 * s + 1 :].reshape(s, width)

    @classmethod
    def from_host(
        cls,
        cu_seqlens_q: np.ndarray,
        kv_lens: np.ndarray,
        page_table: np.ndarray,
        page_size: int,
        device: torch.device | str = "cpu",
        validate: bool = True,
        max_q_len: int | None = None,
        max_kv_len: int | None = None,
        causal: bool = True,
    ) -> "AttentionMetadata":
        """Metadata from host arrays (any integer dtype), copied into one packed
        int32 buffer (the host fields are views of it). ``validate=False`` skips the
        consistency checks, for metadata a layout built (the engine's per-forward
        path; the layouts are property-tested), and the caller may pass the maxima
        it already knows."""
        cu, kv, pt = np.asarray(cu_seqlens_q), np.asarray(kv_lens), np.asarray(page_table)
        if validate:
            cls._validate(cu, kv, pt, page_size, causal)
        s = kv.shape[0]
        buf, cu_h, kv_h, pt_h = cls.host_buffers(s, pt.shape[1])
        cu_h[:] = cu
        kv_h[:] = kv
        pt_h[:] = pt
        if max_q_len is None:
            max_q_len = int(np.maximum.reduce(cu_h[1:] - cu_h[:-1])) if s else 0
        if max_kv_len is None:
            max_kv_len = int(np.maximum.reduce(kv_h)) if s else 0
        return cls(cu_h, kv_h, pt_h, page_size, max_q_len, max_kv_len, device, _packed=buf, causal=causal)

    @staticmethod
    def _validate(cu: np.ndarray, kv: np.ndarray, pt: np.ndarray, page_size: int, causal: bool = True) -> None:
        if cu.ndim != 1 or kv.ndim != 1 or cu.shape[0] != kv.shape[0] + 1:
            raise ValueError(
                f"cu_seqlens_q must have one more entry than kv_lens; got {cu.shape} and {kv.shape}"
            )
        q_lens = cu[1:] - cu[:-1]
        if pt.ndim != 2 or pt.shape[0] != kv.shape[0]:
            raise ValueError(f"page_table must be [num_segments={kv.shape[0]}, pages]; got {pt.shape}")
        if (q_lens < 0).any() or (kv < 0).any():
            raise ValueError("every segment needs q_len >= 0 and kv_len >= 0")
        if causal and (q_lens > kv).any():
            raise ValueError("every causal segment needs q_len <= kv_len")
        if kv.size and int(kv.max()) > pt.shape[1] * page_size:
            raise ValueError(
                f"kv_len {int(kv.max())} exceeds the page table's {pt.shape[1]} pages of {page_size}"
            )


_new_object = object.__new__
(_SET_CU, _SET_KV, _SET_PT, _SET_PS, _SET_MQ, _SET_MK, _SET_DEV, _SET_PACKED, _SET_TENSORS, _SET_STATIC,
 _SET_CAUSAL) = (AttentionMetadata.__dict__[name].__set__ for name in (
    "cu_seqlens_q_host", "kv_lens_host", "page_table_host", "page_size", "max_q_len", "max_kv_len", "device",
    "_packed", "_tensors", "static", "causal"))


@dataclass(frozen=True)
class AttentionSpec:
    """Static shape facts a backend is built for."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    scale: float
    kv_layout: KVLayout = "NHD"

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {self.kv_layout!r}")


class Attention(ABC):
    """The attention a forward runs: the one type every seam that holds it names (the
    engine's parts, :class:`graphcp.runtime.body.Body`, the KV exchange's
    ``KVForward.backend``, a family's ``make_attention``). Two kinds implement it:

    - an :class:`AttentionBackend` attends paged K/V heads: the KV exchange calls its
      ``forward(q, kv_cache, meta, out, lse)`` for a layer (a cache mode's all-gather, a
      ring's steps, a decode phase's merge);
    - a family's own attention over its cache's storage (a sparse attention in the
      family's folder: docs/structure.md's table of the typed seams names them) takes
      the cache itself: the family's layers call its ``forward(layer, q, ...,
      cache, ..., out)`` in the attention break, with the forward's storage
      (``ctx.kv.cache.storage``) and the inputs its layers computed.

    Phases, for both: ``prepare(meta, requests)`` (host side, once per forward, before any
    replay: the live batch's metadata and, for an attention that :attr:`reads_batch`,
    every request of the batch), then per layer ``forward``, and after the forward
    ``forward_stats``."""

    name: str = "base"
    #: the attention can run inside a captured graph, reading only static device metadata
    supports_full_graph: bool = False
    #: its kernels are CUDA kernels: the command line refuses it with --device cpu (tests
    #: still build it on a CPU, over fakes of its kernel library)
    gpu_kernels: bool = False
    #: its planning reads every request of the batch (:class:`BatchRequests`: lengths and
    #: pages), as a pooling over each request's pages does: the body hands ``prepare`` the
    #: batch's requests (built only for such an attention)
    reads_batch: bool = False

    @classmethod
    def device_problem(cls, device: torch.device | str) -> str | None:
        """Why this attention cannot run on ``device`` in this process, or None: checked
        before construction, so a refusal is one line, not a kernel library's traceback."""
        return None

    def prepare(self, meta: AttentionMetadata,  # noqa: B027 - optional phase
                requests: BatchRequests | None = None) -> None:
        """Host-side planning for this forward's metadata (no-op by default). ``requests``:
        every request of the batch, for an attention that :attr:`reads_batch` (None: an
        inert batch, as a capture runs, or an attention that does not read it)."""

    def forward_stats(self, prefix_lens: np.ndarray, extend_lens: np.ndarray) -> dict:
        """Figures of the last forward for ForwardInfo.stats (given the batch's lengths): none by default."""
        return {}

    def decode_graph_attention(self, meta: AttentionMetadata) -> "Attention | None":
        """What a decode graph over the static metadata ``meta`` of its bucket captures in
        place of this attention (one that reads no host value); None: the paged decode
        attention over K/V heads (graphcp.attention.decode.paged). A family's own
        attention gives its own form."""
        return None

    @abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> None:
        """One layer's attention of this rank's query rows: the kind's call (the class doc):
        an :class:`AttentionBackend`'s ``(q, kv_cache, meta, out, lse)``, or a family's
        attention's own arguments, the cache's storage among them."""


class AttentionBackend(Attention):
    """An attention over paged K/V heads (:class:`Attention`'s first kind), built from an
    :class:`AttentionSpec`: what the registry builds (``attention/backends/``) and the KV
    exchange calls. ``forward`` may run inside a captured graph when
    ``supports_full_graph``."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Attend ``q`` [rows, Hq, D] over ``kv_cache`` (one layer, see
        :mod:`graphcp.kv.paged`); write ``out`` [rows, Hq, D] and, when given,
        ``lse`` [rows, Hq] float32 (base e) for the rows of every segment."""


class DecodeKernel(AttentionBackend):
    """A paged decode kernel: one query row a segment (a decode step's request) over the
    keys this rank holds of it, reading only that request's pages, with the natural-log
    LSE a merge needs (a row with no key: output 0, LSE -inf). What a decode graph
    captures (graphcp.runtime.capture.phases.DecodeGraphs, docs/decode.md): its metadata
    is the bucket's static device buffers (the page table ``[rows, width]``, the lengths
    ``[rows]``), so ``q`` has the bucket's rows and nothing is read on the host. Registered
    for an attention backend with ``register_decode_backend`` (graphcp.attention.catalog)."""

    supports_full_graph = True
    #: its host planning (``prepare``) must run before every step, not only before the
    #: capture: FlashInfer's wrapper plans its schedule on the host
    plans_steps: bool = False
    #: it keeps nothing sized by a batch (no per-bucket buffers or limits), so an eager
    #: decode step of any size runs it too, not only a decode graph
    any_batch: bool = True

    def bucket(self, rows: int) -> None:  # noqa: B027 - optional
        """The batch-size bucket (rows) the next ``prepare`` and ``forward`` are for: a
        kernel whose device buffers are fixed per batch size keeps one set a bucket."""


@dataclass(slots=True)
class RankInputs:
    """This rank's host inputs for one planned batch (what a planner writes)."""

    ids: np.ndarray  # [n] token ids of this rank's rows
    positions: np.ndarray  # [n] absolute positions
    slots: np.ndarray  # [n] cache slots
    meta: AttentionMetadata  # its segments (a ring: step 0's)
    seg_page_table: np.ndarray  # [S, width] the segments' page table
    plan: Any = None  # the exchange's own per-forward plan (a ring's RingPlan; None: none)


@dataclass(frozen=True)
class BatchRequests:
    """Every request of the batch (the same on every rank): cached and new tokens, pages.
    What an attention that reads the whole batch in its planning is given
    (:attr:`Attention.reads_batch`: one that pools over each request's pages)."""

    prefix_lens: np.ndarray  # int64 [R]
    extend_lens: np.ndarray  # int64 [R]
    pages: np.ndarray  # int [R, width]: each request's page ids

    @classmethod
    def none(cls) -> "BatchRequests":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, np.zeros((0, 1), dtype=np.int64))
