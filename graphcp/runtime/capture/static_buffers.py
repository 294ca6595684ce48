"""The static inputs and outputs of a captured body, one object a phase.

Each owns every tensor a phase's captured graphs read or write on a rank, allocated
once at the largest bucket; a bucket uses prefix views (``[:cap]`` rows). ``fill``
copies the live batch in and pads the bucket's tail inertly: token 0, position 0, slot
-1 (the scratch page), so nothing of an earlier, larger batch survives into what a
later one reads.

- :class:`StaticBuffers` (a prefill): CP-local, this rank's rows only (the KV exchange
  all-gathers the slot mapping inside the body); padding rows are in no attention
  segment; a full graph's segment metadata.
- :class:`DecodeBuffers` (a decode step): one row a request, the same on every rank,
  and the attention's static metadata: each request's length and page-table row (a
  padding row's length is 0: output 0, LSE -inf, which a merge skips).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import is_

import numpy as np
import torch

from graphcp.attention.staging import PinnedStaging
from graphcp.jit import host_kernel
from graphcp.kv.decode import state_rows
from graphcp.model.forward_context import StaticInputs


@dataclass
class BucketView:
    """The prefix views one bucket's graph was captured on."""

    capacity: int
    input_ids: torch.Tensor  # [cap] int64
    positions: torch.Tensor  # [cap] int64
    kv_slots: torch.Tensor  # [cap] int64: cache slot of each local row (-1 = padding)
    attn_q: torch.Tensor  # [cap, Hq, D]  attention input (static so breaks pin no graph memory)
    attn_out: torch.Tensor  # [cap, Hq, D]
    hidden_out: torch.Tensor  # [cap, hidden]  the body's output rows
    # full-graph attention metadata (static device tensors; segments past the batch are empty)
    cu_seqlens_q: torch.Tensor  # [S_max + 1] int32
    kv_lens: torch.Tensor  # [S_max] int32
    page_table: torch.Tensor  # [S_max, P_max] int32
    #: a model's own break rows by name ([cap, *row]; StaticBuffers' ``extra_rows``)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # residual rows into / out of an expert-parallel MoE layer's break (None: no such layer)
    moe_resid: torch.Tensor | None = None  # [cap, hidden]
    moe_out: torch.Tensor | None = None  # [cap, hidden]
    #: a later pipeline stage's input rows (the previous stage's hidden states)
    hidden_in: torch.Tensor | None = None  # [cap, hidden]
    #: auxiliary hidden states the captured segments copy out
    aux_out: torch.Tensor | None = None  # [cap, n_aux, hidden]

    def inputs(self, live_rows: int) -> StaticInputs:
        """The forward context's static inputs of a forward on this bucket (its breaks
        read and write these rows)."""
        return StaticInputs(self.attn_q, self.attn_out, self.extra or None, self.moe_resid, self.moe_out, live_rows)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        out.update({f"extra.{k}": v for k, v in self.extra.items()})
        return out


class StaticBuffers:
    def __init__(
        self,
        max_capacity: int,
        cp_size: int,
        num_q_heads: int,
        head_dim: int,
        hidden_size: int,
        max_segments: int,
        max_pages_per_seq: int,
        dtype: torch.dtype,
        device: torch.device | str,
        moe_rows: bool = False,
        hidden_in: bool = False,
        aux_layers: int = 0,
        extra_rows: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        staging: PinnedStaging | None = None,
        hidden_in_size: int | None = None,
        hidden_out_size: int | None = None,
    ) -> None:
        """``hidden_in``: the body takes input rows (a pipeline stage after the first);
        ``aux_layers``: how many layers' auxiliary hidden states it copies out;
        ``extra_rows``: name -> (row shape, dtype) of the rows a model's breaks read
        and write besides attn_q / attn_out (MLA's query and output, say);
        ``hidden_in_size`` / ``hidden_out_size``: the widths of the input and output rows
        (default ``hidden_size``; DeepSeek V4 hands its hc_mult residual streams between
        stages); ``staging``: how inputs reach the device (None: pinned staging on CUDA, the
        static tensors themselves written in place on CPU; tests pass a fake copy engine)."""
        self.max_capacity, self.cp_size = max_capacity, cp_size
        self.max_segments, self.max_pages_per_seq = max_segments, max_pages_per_seq
        dev = torch.device(device)
        self.device = dev
        self.input_ids = torch.zeros(max_capacity, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_capacity, dtype=torch.long, device=dev)
        self.kv_slots = torch.full((max_capacity,), -1, dtype=torch.long, device=dev)
        self.attn_q = torch.zeros(max_capacity, num_q_heads, head_dim, dtype=dtype, device=dev)
        self.attn_out = torch.zeros(max_capacity, num_q_heads, head_dim, dtype=dtype, device=dev)
        self.hidden_out = torch.zeros(max_capacity, hidden_out_size or hidden_size, dtype=dtype, device=dev)
        self.cu_seqlens_q = torch.zeros(max_segments + 1, dtype=torch.int32, device=dev)
        self.kv_lens = torch.zeros(max_segments, dtype=torch.int32, device=dev)
        self.page_table = torch.zeros(max_segments, max_pages_per_seq, dtype=torch.int32, device=dev)
        self.extra = {name: torch.zeros(max_capacity, *row, dtype=dt, device=dev)
                      for name, (row, dt) in (extra_rows or {}).items()}
        # only models with an expert-parallel MoE layer have a break that takes residual rows
        self.moe_resid = torch.zeros(max_capacity, hidden_size, dtype=dtype, device=dev) if moe_rows else None
        self.moe_out = torch.zeros(max_capacity, hidden_size, dtype=dtype, device=dev) if moe_rows else None
        self.hidden_in = (torch.zeros(max_capacity, hidden_in_size or hidden_size, dtype=dtype, device=dev)
                          if hidden_in else None)
        self.aux_out = (torch.zeros(max_capacity, aux_layers, hidden_size, dtype=dtype, device=dev)
                        if aux_layers else None)
        # host staging: on CPU the static tensors themselves (numpy views share their
        # memory, so a fill is in place); on CUDA pinned copies, uploaded per bucket and
        # fenced (a fill waits until the previous fill's uploads ran before rewriting them)
        self._views: dict[int, tuple[tuple, BucketView]] = {}
        self._staging = staging if staging is not None else PinnedStaging(dev) if dev.type == "cuda" else None
        self._staged = self._staging is not None
        if self._staged:
            self._ids_host = self._staging.host(max_capacity, torch.long)
            self._pos_host = self._staging.host(max_capacity, torch.long)
            self._slots_host = self._staging.host(max_capacity, torch.long, -1)
        #: the pinned staging copy of the full graph's segment metadata (allocated on its first fill)
        self._seg_host: torch.Tensor | None = None
        self._host_cache: tuple = ((), ())
        #: rows [0, _dirty) of the host inputs may hold a batch; past it they are inert
        #: (as allocated: token 0, position 0, slot -1)
        self._dirty = 0

    def _host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """numpy views of what fill writes: the pinned staging copies on CUDA, the
        static tensors themselves on CPU (re-derived if a tensor was replaced)."""
        if self._staged:
            tensors = (self._ids_host, self._pos_host, self._slots_host)
        else:
            tensors = (self.input_ids, self.positions, self.kv_slots)
        cached, arrays = self._host_cache
        if not cached or not all(map(is_, cached, tensors)):
            arrays = tuple(t.numpy() for t in tensors)
            if cached:
                self._dirty = self.max_capacity  # a replaced tensor: nothing known to be inert
            self._host_cache = (tensors, arrays)
        return arrays

    def _bases(self) -> tuple:
        return (self.input_ids, self.positions, self.kv_slots, self.attn_q, self.attn_out, self.hidden_out,
                self.cu_seqlens_q, self.kv_lens, self.page_table, self.moe_resid, self.moe_out, self.hidden_in,
                self.aux_out, *self.extra.values())

    def view(self, capacity: int) -> BucketView:
        """Prefix views of the bucket (cached; rebuilt if a buffer was replaced, so
        the runner's checks see what a replay would really read)."""
        bases = self._bases()
        hit = self._views.get(capacity)
        if hit is None or not all(map(is_, hit[0], bases)):
            hit = self._views[capacity] = (bases, self._make_view(capacity))
        return hit[1]

    def _make_view(self, capacity: int) -> BucketView:
        if capacity > self.max_capacity:
            raise ValueError(f"bucket capacity {capacity} exceeds the buffers' {self.max_capacity}")
        c = capacity
        return BucketView(
            capacity=c,
            input_ids=self.input_ids[:c],
            positions=self.positions[:c],
            kv_slots=self.kv_slots[:c],
            attn_q=self.attn_q[:c],
            attn_out=self.attn_out[:c],
            hidden_out=self.hidden_out[:c],
            cu_seqlens_q=self.cu_seqlens_q,
            kv_lens=self.kv_lens,
            page_table=self.page_table,
            extra={name: t[:c] for name, t in self.extra.items()},
            moe_resid=None if self.moe_resid is None else self.moe_resid[:c],
            moe_out=None if self.moe_out is None else self.moe_out[:c],
            hidden_in=None if self.hidden_in is None else self.hidden_in[:c],
            aux_out=None if self.aux_out is None else self.aux_out[:c],
        )

    def addresses(self) -> dict[str, int]:
        """Data pointers of every static tensor (debug mode checks they never move)."""
        names = ("input_ids", "positions", "kv_slots", "attn_q", "attn_out", "hidden_out",
                 "cu_seqlens_q", "kv_lens", "page_table", "moe_resid", "moe_out", "hidden_in", "aux_out")
        out = {n: getattr(self, n).data_ptr() for n in names if getattr(self, n) is not None}
        out.update({f"extra.{n}": t.data_ptr() for n, t in self.extra.items()})
        return out

    def fill(
        self,
        capacity: int,
        input_ids: np.ndarray,
        positions: np.ndarray,
        kv_slots: np.ndarray,
        cu_seqlens_q: np.ndarray | None = None,
        kv_lens: np.ndarray | None = None,
        page_table: np.ndarray | None = None,
        hidden_in: torch.Tensor | None = None,
    ) -> BucketView:
        """Copy one rank's live rows (token ids, positions, KV cache slots; on a later
        pipeline stage its input rows ``hidden_in``) into the bucket's views and pad
        inertly (0, 0, -1; zero input rows).

        Everything is CP-local: the KV exchange all-gathers the slots with the rows,
        so a rank's host work is proportional to its own rows, not the batch's.
        Only the bucket's own prefix is written: a graph of capacity ``cap`` reads
        nothing past it, and every row of it is rewritten, so nothing of an earlier
        batch survives into what a later one reads. Segment metadata is only needed
        in full-graph mode.
        """
        n = input_ids.shape[0]
        if n > capacity:
            raise ValueError(f"{n} local rows do not fit bucket capacity {capacity}")
        if capacity > self.max_capacity:
            raise ValueError(f"bucket capacity {capacity} exceeds the buffers' {self.max_capacity}")
        if positions.shape[0] != n or kv_slots.shape[0] != n:
            raise ValueError(
                f"input_ids, positions and kv_slots must have one entry per local row; got {n}, "
                f"{positions.shape[0]} and {kv_slots.shape[0]}"
            )
        if self._staged:
            self._staging.wait()  # the previous fill's uploads read these buffers when they run
        ids, pos, slots = self._host_arrays()
        # re-pad only the rows an earlier fill may have left live: the rest is inert
        dirty = self._dirty
        _fill_rows(ids, pos, slots, input_ids, positions, kv_slots, min(capacity, dirty))
        # rows past this bucket keep what they held; within it only the first n are live
        self._dirty = dirty if dirty > capacity else n
        if self._staged:
            self._staging.upload(self.input_ids[:capacity], self._ids_host[:capacity])
            self._staging.upload(self.positions[:capacity], self._pos_host[:capacity])
            self._staging.upload(self.kv_slots[:capacity], self._slots_host[:capacity])
        if cu_seqlens_q is not None:
            self._fill_segments(cu_seqlens_q, kv_lens, page_table)
        if self._staged:
            self._staging.mark()  # after every upload of this fill: the next fill waits for them
        if self.hidden_in is not None:
            if n and (hidden_in is None or hidden_in.shape[0] < n):
                raise ValueError(f"this stage's body takes input rows: expected hidden_in with >= {n} rows, "
                                 f"got {None if hidden_in is None else tuple(hidden_in.shape)}")
            if n:
                self.hidden_in[:n].copy_(hidden_in[:n])
            self.hidden_in[n:capacity].zero_()
        return self.view(capacity)

    def _fill_segments(self, cu_seqlens_q: np.ndarray, kv_lens: np.ndarray, page_table: np.ndarray) -> None:
        s = kv_lens.shape[0]
        if s > self.max_segments:
            raise ValueError(f"{s} segments exceed the buffers' {self.max_segments} (raise max_requests)")
        if page_table.shape[1] > self.max_pages_per_seq:
            raise ValueError(f"{page_table.shape[1]} pages per request exceed the buffers' {self.max_pages_per_seq}")
        S, w = self.max_segments, page_table.shape[1]
        # one packed int32 buffer: the pinned staging copy on CUDA (fenced with the rows'),
        # a temporary on CPU, where the copies are plain memory copies
        if self._staged:
            if self._seg_host is None:
                self._seg_host = self._staging.host(2 * S + 1 + S * self.max_pages_per_seq, torch.int32)
            host = self._seg_host
        else:
            host = torch.empty(2 * S + 1 + s * w, dtype=torch.int32)
        cu, kv, pt = host[: S + 1], host[S + 1 : 2 * S + 1], host[2 * S + 1 : 2 * S + 1 + s * w].view(s, w)
        cu_np, kv_np = cu.numpy(), kv.numpy()
        cu_np[:] = cu_seqlens_q[-1]
        cu_np[: s + 1] = cu_seqlens_q
        kv_np[:] = 0
        kv_np[:s] = kv_lens
        pt.numpy()[:] = page_table
        # only the live block of the page table: a kernel reads page p of segment s only when
        # p * page_size < kv_lens[s], and every other entry belongs to an empty segment or lies past its kv length
        for dst, src in ((self.cu_seqlens_q, cu), (self.kv_lens, kv), (self.page_table[:s, :w], pt)):
            if self._staged:
                self._staging.upload(dst, src)
            else:
                dst.copy_(src)


def _fill_rows_np(ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, input_ids: np.ndarray,
                  positions: np.ndarray, kv_slots: np.ndarray, end: int) -> None:
    """:func:`_fill_rows` as slice assignments (the form that runs without numba)."""
    n = input_ids.shape[0]
    ids[:n], pos[:n], slots[:n] = input_ids, positions, kv_slots
    ids[n:end], pos[n:end], slots[n:end] = 0, 0, -1


@host_kernel(fallback=_fill_rows_np)
def _fill_rows(ids, pos, slots, input_ids, positions, kv_slots, end):
    """The live rows into the host views (``input_ids`` etc., n of each), then rows n
    up to ``end`` padded inertly: token 0, position 0, slot -1 (one call)."""
    n = input_ids.shape[0]
    for i in range(n):  # (a loop an array: each a vectorised copy)
        ids[i] = input_ids[i]
    for i in range(n):
        pos[i] = positions[i]
    for i in range(n):
        slots[i] = kv_slots[i]
    for i in range(n, end):
        ids[i] = 0
        pos[i] = 0
        slots[i] = -1


@dataclass
class DecodeView:
    """The prefix views one decode bucket's graph was captured on: ``capacity`` requests
    over ``width`` pages each."""

    capacity: int
    width: int
    input_ids: torch.Tensor  # [cap] int64: each request's new token
    positions: torch.Tensor  # [cap] int64
    kv_slots: torch.Tensor  # [cap] int64: this rank's cache slot of the new token (-1: another rank's, padding)
    kv_lens: torch.Tensor  # [cap] int32: the tokens this rank holds of each request
    page_table: torch.Tensor  # [cap, width] int32
    cu_seqlens_q: torch.Tensor  # [cap + 1] int32: one query row a request
    hidden_out: torch.Tensor  # [cap, hidden]  the body's output rows
    #: [2, cap] int64: each row's state slot read and written (a storage with per-request
    #: state: graphcp.kv.decode.state_rows; zeros otherwise)
    state_slots: torch.Tensor
    hidden_in: None = None  # (a decode step's body takes no input rows)
    #: [cap, layers, hidden]: the auxiliary hidden states the step copies out (None: none asked)
    aux_out: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}


class DecodeBuffers:
    """The static buffers of a decode step's graphs: ``max_requests`` rows, page tables of
    ``width`` pages (the cache's table width), uploaded from pinned host memory on CUDA
    without blocking and fenced, as :class:`StaticBuffers` are; plain memory on a CPU."""

    def __init__(self, max_requests: int, width: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str, staging: PinnedStaging | None = None, aux_layers: int = 0) -> None:
        n, dev = max_requests, torch.device(device)
        self.width = width
        # ids, positions, slots, state slots (read, write): one buffer, so a fill uploads them in one copy
        self._rows = torch.zeros(5, n, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.kv_slots = self._rows[:3].unbind(0)
        self.state_slots = self._rows[3:]
        self.kv_slots.fill_(-1)
        self.kv_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.page_table = torch.zeros((n, width), dtype=torch.int32, device=dev)
        self.hidden_out = torch.zeros(n, hidden_size, dtype=dtype, device=dev)
        #: the auxiliary hidden states a step copies out (an EAGLE-3 draft's inputs of a verify step)
        self.aux_out = torch.zeros(n, aux_layers, hidden_size, dtype=dtype, device=dev) if aux_layers else None
        self._staging = staging if staging is not None else PinnedStaging(dev) if dev.type == "cuda" else None
        host = self._staging.host if self._staging is not None else _plain_host
        self._rows_host = host(5 * n, torch.int64)  # the five rows: [5, capacity] packed in front
        self._lens_host = host(n, torch.int32)
        self._table_host = host(n * width, torch.int32)
        # their numpy views, made once (the host buffers never move)
        self._rows_np, self._lens_np, self._table_np = (t.numpy() for t in (self._rows_host, self._lens_host,
                                                                             self._table_host))
        self._views: dict[tuple[int, int], DecodeView] = {}

    def view(self, capacity: int, width: int) -> DecodeView:
        """Prefix views of bucket ``(capacity, width)`` (made once)."""
        got = self._views.get((capacity, width))
        if got is None:
            c = capacity
            got = self._views[c, width] = DecodeView(
                c, width, self.input_ids[:c], self.positions[:c], self.kv_slots[:c], self.kv_lens[:c],
                self.page_table[:c, :width], self.cu_seqlens_q[: c + 1], self.hidden_out[:c], self.state_slots[:, :c],
                aux_out=None if self.aux_out is None else self.aux_out[:c])
        return got

    def addresses(self) -> dict[str, int]:
        """Data pointers of every static tensor (debug mode checks they never move)."""
        names = ("input_ids", "positions", "kv_slots", "kv_lens", "cu_seqlens_q", "page_table", "hidden_out",
                 "state_slots", "aux_out")
        return {n: getattr(self, n).data_ptr() for n in names if getattr(self, n) is not None}

    def fill(self, prep, capacity: int, width: int, kv) -> DecodeView:
        """A decode step's rows (``prep``: its PreparedBatch; None: none) into the bucket's
        buffers, the rest inert: token 0, position 0, slot -1, length 0 (``kv``: the cache
        whose page table the rows are read from)."""
        B = 0 if prep is None else prep.rows
        if self._staging is not None:
            self._staging.wait()  # the previous fill's uploads read these buffers when they run
        rows, lens = self._rows_np[: 5 * capacity].reshape(5, capacity), self._lens_np[:capacity]
        table = self._table_np[: capacity * width].reshape(capacity, width)
        rows[:2, B:], rows[2, B:], lens[B:], table[B:] = 0, -1, 0, 0
        if prep is not None:
            rows[:3, :B] = prep.ids, prep.positions, prep.slots
            lens[:B] = prep.decode.local_lens
            kv.page_table_rows(prep.decode.rows, width, out=table[:B])
        state_rows(None if prep is None else prep.decode.states, capacity, rows[3:])
        # contiguous host sources: a strided one would be copied to pageable memory first
        self._upload(self._rows[:, :capacity], self._rows_host[: 5 * capacity].view(5, capacity))
        self._upload(self.kv_lens[:capacity], self._lens_host[:capacity])
        self._upload(self.page_table[:capacity, :width], self._table_host[: capacity * width].view(capacity, width))
        if self._staging is not None:
            self._staging.mark()  # after every upload of this fill: the next fill waits for them
        return self.view(capacity, width)

    def _upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._staging is None:
            dst.copy_(src)
        else:
            self._staging.upload(dst, src)


def _plain_host(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)
