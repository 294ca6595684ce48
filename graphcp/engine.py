"""PrefillEngine: requests -> plan -> buffers -> eager body | graph replay -> outputs.

SPMD: every rank of the CP group calls :meth:`PrefillEngine.prefill` with the
same batch. Each rank runs the body on the rows the layout gives it; K/V are
all-gathered so attention stays exact; the last-token rows are combined across
ranks and every rank returns the same first-token logits.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata, AttentionSpec
from graphcp.attention.registry import make_attention, preferred_kv_layout
from graphcp.capture.buckets import BucketSet
from graphcp.config import ConfigError, ParallelConfig, RuntimeConfig
from graphcp.cp import Plan, make_layout
from graphcp.dist import CPGroup
from graphcp.errors import BatchError, GraphcpError
from graphcp.forward_context import ForwardContext
from graphcp.kvcache import KVHandle, KVHandleError, PagedKVCache
from graphcp.model.loader import load_model
from graphcp.model.presets import resolve_model
from graphcp.profiling import nvtx_range


class ConsistencyError(GraphcpError, RuntimeError):
    """Ranks were given different batches (the SPMD contract is broken)."""


@dataclass
class Request:
    """New tokens of one request, optionally extending an already-cached prefix."""

    tokens: Sequence[int] | np.ndarray | torch.Tensor
    prefix: KVHandle | None = None


@dataclass
class ForwardInfo:
    path: str  # "eager" | "graph"
    capacity: int  # local rows the body ran on (bucket capacity, or the unpadded max)
    required: int  # the largest rank's local rows
    fallback: str | None = None  # why a graph-mode forward ran eagerly
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class PrefillOutput:
    last_logits: torch.Tensor  # float32 [R, vocab], identical on every rank
    handles: list[KVHandle]  # each request's KV (prefix + new tokens): pass as the next chunk's prefix
    logits: list[torch.Tensor] | None  # float32 [new_tokens_i, vocab] when asked
    info: ForwardInfo


@dataclass
class _Prepared:
    """Host-side result of planning one batch on this rank."""

    plan: Plan
    seq_ids: list[int]
    ids: np.ndarray  # [n] this rank's rows: token ids,
    positions: np.ndarray  # [n] absolute positions
    slots: np.ndarray  # [n] and KV cache slots (the exchange all-gathers them with the rows)
    meta: AttentionMetadata
    seg_page_table: np.ndarray


class PrefillEngine:
    def __init__(
        self,
        model: str | Path = "default",
        runtime: RuntimeConfig | None = None,
        group: CPGroup | None = None,
        buckets: BucketSet | None = None,
        parallel: ParallelConfig | None = None,
    ) -> None:
        self.runtime = runtime or RuntimeConfig()
        self.group = group or CPGroup()
        self.parallel = parallel or ParallelConfig(cp_size=self.group.size)
        if self.parallel.cp_size != self.group.size:
            raise ConfigError(f"cp_size={self.parallel.cp_size} but the process group has {self.group.size} ranks")
        rt = self.runtime
        self.device = torch.device(rt.device)
        self.dtype = rt.torch_dtype
        self.model_dir = resolve_model(model)
        self.cfg, self.model = load_model(
            self.model_dir, self.dtype, self.device, rank=self.group.rank, tp_size=self.parallel.tp_size
        )
        self.parallel.check_model(self.cfg)
        self.layout = make_layout(rt.layout, self.parallel.cp_size)
        kv_layout = preferred_kv_layout(rt.attention, self.device)
        kv_tokens = rt.kv_tokens if rt.kv_tokens is not None else min(4 * self.cfg.max_position_embeddings, 1 << 16)
        num_pages = -(-kv_tokens // rt.page_size) + 1  # + the scratch page
        self._check_pool_fits(num_pages)
        self.kv = PagedKVCache(
            self.cfg.num_layers, num_pages, rt.page_size, self.cfg.num_kv_heads, self.cfg.head_dim,
            self.dtype, self.device, kv_layout,
            # no request outgrows the model's context (prefill checks it before extend)
            max_pages_per_seq=min(num_pages - 1, -(-self.cfg.max_position_embeddings // rt.page_size)),
        )
        spec = AttentionSpec(
            self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, rt.page_size,
            self.cfg.head_dim ** -0.5, kv_layout,
        )
        self.max_context = self.cfg.max_position_embeddings
        self.buckets = buckets or BucketSet()
        limits = self._attention_limits(num_pages)
        try:
            self.attention = make_attention(rt.attention, spec, self.device, **limits)
        except (ValueError, ImportError) as e:  # a backend refusing this model or device, or not installed
            raise ConfigError(f"--attention {rt.attention}: {e}") from e
        self.buckets.check_compatible(self.parallel.cp_size, rt.layout)
        self.runner = None
        if rt.graph != "off":
            from graphcp.capture.runner import GraphRunner  # the graph machinery only when asked for

            self.runner = GraphRunner(self, self.buckets)

    def _check_pool_fits(self, num_pages: int) -> None:
        """Refuse a KV pool larger than the device's memory up front (a clear error,
        not an allocator failure or the OOM killer halfway through zeroing it)."""
        rt, cfg = self.runtime, self.cfg
        need = cfg.num_layers * num_pages * 2 * rt.page_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        if self.device.type == "cuda":
            have = torch.cuda.mem_get_info(self.device)[0]
        else:
            try:
                have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (AttributeError, ValueError, OSError):  # not POSIX: let the allocator decide
                return
        if need > have:
            raise ConfigError(
                f"kv_tokens={rt.kv_tokens}: a KV pool of {(num_pages - 1) * rt.page_size} tokens needs "
                f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB {self.device.type} memory (lower --kv-tokens)"
            )

    def _attention_limits(self, num_pages: int) -> dict:
        """Static sizes the kernel backends preallocate for (each takes what it needs)."""
        rt, C = self.runtime, self.parallel.cp_size
        if rt.layout == "interleave" and rt.attention in ("flashinfer", "trtllm"):
            raise ConfigError(
                f"--attention {rt.attention} runs the zigzag layout; interleave's one-row segments make its "
                "batch as large as the rank's rows (use --attention torch or triton with interleave)"
            )
        max_rows = max(self.buckets.largest, -(-num_pages * rt.page_size // C))
        max_segments = 2 * rt.max_requests if rt.layout == "zigzag" else max_rows
        pages_per_seq = -(-self.max_context // rt.page_size)
        return {
            "max_segments": max_segments,
            # early and late zigzag segments both list their request's pages, empty segments one
            "max_pages": 2 * num_pages + max_segments,
            "max_pages_per_segment": pages_per_seq,
            "max_q_rows": max_rows,
            "dtype": self.dtype,
        }

    # ---- public API -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.group.rank

    def capture(self, progress: bool = False):
        """Capture every bucket (graph mode); returns per-bucket capture stats."""
        if self.runner is None:
            raise ConfigError("graph='off': nothing to capture")
        return self.runner.capture_all(progress=progress)

    def release(self, handle: KVHandle) -> None:
        """Free a handle's KV pages; KVHandleError (a BatchError) for a handle that is
        not live here (released already, or from another engine)."""
        self.kv.release(handle)

    @torch.inference_mode()
    def prefill(self, batch: Sequence[Request], all_logits: bool = False, force_eager: bool = False) -> PrefillOutput:
        with nvtx_range("prefill", category="forward"):  # the top-level range profiles measure against
            return self._prefill(batch, all_logits, force_eager)

    def _prefill(self, batch: Sequence[Request], all_logits: bool, force_eager: bool) -> PrefillOutput:
        t0 = time.perf_counter()
        prep = self.prepare_batch(batch)
        try:
            t1 = time.perf_counter()
            hidden, info = self._run_body(prep, force_eager)
            info.timings["plan_s"] = t1 - t0
            with nvtx_range("lm_head", category="output"):
                last_logits = self._last_logits(prep.plan, hidden)
                logits = self._all_logits(prep.plan, hidden) if all_logits else None
        except BaseException:
            self.abort(prep)
            raise
        info.timings["total_s"] = time.perf_counter() - t0
        return PrefillOutput(last_logits, [self.kv.handle(s) for s in prep.seq_ids], logits, info)

    def prepare_batch(self, batch: Sequence[Request]) -> "_Prepared":
        """Validate, check SPMD consistency, plan, reserve KV and build this rank's
        host metadata. Nothing changes when it raises; :meth:`abort` undoes it."""
        with nvtx_range("plan", category="host"):
            flat, extend = self._validate(batch)
            prefix = np.fromiter((0 if r.prefix is None else r.prefix.num_tokens for r in batch),
                                 dtype=np.int64, count=len(batch))
            if self.runtime.check_consistency and self.group.distributed:
                self._check_consistency(flat, extend, prefix, batch)
            plan = self.layout.plan(extend_lens=extend, prefix_lens=prefix)
        seq_ids = self.kv.extend([r.prefix for r in batch], extend.tolist())
        try:
            return self._prepare(plan, seq_ids, flat)
        except BaseException:
            self.kv.rollback(seq_ids, extend.tolist())
            raise

    def abort(self, prep: "_Prepared") -> None:
        """Give back the KV a prepared batch reserved (its forward failed or was dropped)."""
        self.kv.rollback(prep.seq_ids, prep.plan.extend_lens.tolist())

    # ---- steps ------------------------------------------------------------------
    def _validate(self, batch: Sequence[Request]) -> tuple[np.ndarray, np.ndarray]:
        """The batch's token ids, flattened in batch order (int64), and each request's
        number of new tokens; BatchError naming the request when something is wrong
        (types included: every refused batch is a BatchError, and changes nothing)."""
        if isinstance(batch, (str, bytes)) or not isinstance(batch, SequenceABC):
            raise BatchError(f"a batch must be a list of graphcp.Request, got {type(batch).__name__}")
        if len(batch) == 0:
            raise BatchError("empty batch: prefill needs at least one request")
        if len(batch) > self.runtime.max_requests and self.attention.name in ("flashinfer", "trtllm"):
            raise BatchError(f"batch has {len(batch)} requests; the {self.attention.name} backend was sized for "
                             f"max_requests={self.runtime.max_requests} (raise --max-requests)")
        vocab = self.cfg.vocab_size
        out = []
        extended: dict[int, int] = {}  # seq_id -> the request extending it
        for j, r in enumerate(batch):
            if not isinstance(r, Request):
                raise BatchError(f"batch item {j}: expected a graphcp.Request, got {type(r).__name__} "
                                 "(wrap token ids as Request(tokens))")
            t = _token_array(r.tokens, j)
            if t.size == 0:
                raise BatchError(f"request {j} is empty: every request needs at least one new token")
            have = 0
            if r.prefix is not None:
                try:
                    self.kv.check_handle(r.prefix)
                except KVHandleError as e:
                    raise KVHandleError(f"request {j}: {e}") from None
                first = extended.setdefault(r.prefix.seq_id, j)
                if first != j:
                    raise KVHandleError(f"requests {first} and {j} both extend KV handle seq_id={r.prefix.seq_id}; "
                                        "a sequence can be extended once per batch")
                have = r.prefix.num_tokens
            if have + t.size > self.max_context:
                raise BatchError(f"request {j}: {have} cached + {t.size} new tokens exceed the model's context of "
                                 f"{self.max_context}")
            if have + t.size > self.kv.capacity_tokens:
                raise BatchError(f"request {j}: {have + t.size} tokens exceed the KV pool of {self.kv.capacity_tokens}")
            out.append(t.astype(np.int64, copy=False))
        # the vocabulary check over the whole batch at once; per request only to name the culprit
        flat = np.concatenate(out) if len(out) > 1 else out[0]
        if int(flat.min()) < 0 or int(flat.max()) >= vocab:
            for j, t in enumerate(out):
                bad = np.flatnonzero((t < 0) | (t >= vocab))
                if bad.size:
                    p = int(bad[0])
                    raise BatchError(
                        f"request {j}, position {p}: token id {int(t[p])} is outside the vocabulary [0, {vocab})"
                    )
        return flat, np.fromiter((t.shape[0] for t in out), dtype=np.int64, count=len(out))

    def _check_consistency(self, flat: np.ndarray, extend: np.ndarray, prefix: np.ndarray, batch) -> None:
        """One small all-gather of a batch fingerprint (CRC32 of the token ids, the
        lengths and the prefix handles): about 0.5 ms on gloo at 2 ranks, tens of
        microseconds on NCCL, plus ~1 us per 4K tokens to hash."""
        crc = zlib.crc32(flat.data)
        shape = np.concatenate([[len(batch)], extend, prefix,
                                [-1 if r.prefix is None else r.prefix.seq_id for r in batch]]).astype(np.int64)
        fp = torch.tensor([[crc, zlib.crc32(shape.tobytes()), int(shape.sum())]], dtype=torch.int64)
        fp = fp.to(self.device)
        allfp = self.group.all_gather_rows(fp).cpu()
        differ = [r for r in range(self.group.size) if not torch.equal(allfp[r], allfp[self.rank])]
        if differ:
            raise ConsistencyError(
                f"rank {self.rank}: ranks {differ} were given a different batch (fingerprint {allfp[self.rank].tolist()} "
                f"vs {[allfp[r].tolist() for r in differ]}); every rank must call prefill with the same requests"
            )

    def _prepare(self, plan: Plan, seq_ids: list[int], flat: np.ndarray) -> _Prepared:
        """This rank's host inputs for one planned batch (``flat``: the batch's token
        ids in batch order, as :meth:`_validate` returns them)."""
        with nvtx_range("prepare", category="host"):
            rp = plan.rank(self.rank)
            seq_rows = self.kv.table_rows(seq_ids)
            # attention metadata written in place into one packed buffer; this rank's
            # segments read pages up to their kv lengths only
            kv_lens = rp.seg_kv_len
            max_kv = max(kv_lens.tolist(), default=0)
            buf, cu, kv, pt = AttentionMetadata.host_buffers(kv_lens.shape[0], max(1, self.kv.pages_for(max_kv)))
            cu[:] = rp.cu_seqlens_q
            kv[:] = kv_lens
            self.kv.page_table_rows(seq_rows[rp.seg_request], pt.shape[1], out=pt)
            meta = AttentionMetadata(cu, kv, pt, self.kv.page_size, max(rp.seg_q_len.tolist(), default=0), max_kv,
                                     self.device, _packed=buf)
            slots = self.kv.slots(seq_rows, rp.positions, rp.seg_request, rp.seg_q_len)
            return _Prepared(plan, seq_ids, flat[rp.rows], rp.positions, slots, meta, pt)

    def make_context(self, meta: AttentionMetadata, kv_slots: torch.Tensor, view=None) -> ForwardContext:
        ctx = ForwardContext(meta, self.attention, self.kv, kv_slots, self.group)
        if view is not None:
            ctx.attn_q, ctx.attn_out = view.attn_q, view.attn_out
        return ctx

    def _run_body(self, prep: _Prepared, force_eager: bool) -> tuple[torch.Tensor, ForwardInfo]:
        required = prep.plan.max_local_rows
        if self.runner is not None and not force_eager:
            out = self.runner.try_replay(prep)
            if out is not None:
                return out
            fallback = self.runner.last_fallback
        else:
            fallback = None
        return self.eager_body(prep, required), ForwardInfo("eager", required, required, fallback)

    @torch.inference_mode()
    def eager_body(self, prep: _Prepared, capacity: int) -> torch.Tensor:
        """The body run eagerly on ``capacity`` rows (>= the largest rank's rows)."""
        n = prep.ids.shape[0]
        ids = np.zeros(capacity, dtype=np.int64)
        pos = np.zeros(capacity, dtype=np.int64)
        slots = np.full(capacity, -1, dtype=np.int64)
        ids[:n], pos[:n], slots[:n] = prep.ids, prep.positions, prep.slots
        ctx = self.make_context(prep.meta, torch.from_numpy(slots).to(self.device))
        with nvtx_range("eager_body", category="eager"):
            self.attention.prepare(prep.meta)
            return self.model.body(torch.from_numpy(ids).to(self.device), torch.from_numpy(pos).to(self.device), ctx)

    def _last_logits(self, plan: Plan, hidden: torch.Tensor) -> torch.Tensor:
        mine = np.flatnonzero(plan.last_owner == self.rank)
        rows = torch.zeros(plan.num_requests, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        if mine.size:
            idx = torch.from_numpy(plan.last_local_index[mine]).to(hidden.device)
            rows[torch.from_numpy(mine).to(hidden.device)] = hidden.index_select(0, idx)
        # every other rank contributes zeros: the sum is exactly the owner's rows
        self.group.all_reduce_(rows)
        return self.model.logits(rows).cpu()

    def _all_logits(self, plan: Plan, hidden: torch.Tensor) -> list[torch.Tensor]:
        everyone = self.group.all_gather_rows(hidden.contiguous())
        rows = everyone.index_select(0, torch.from_numpy(plan.gather_index(hidden.shape[0])).to(hidden.device))
        logits = self.model.logits(rows).cpu()
        return list(torch.split(logits, plan.extend_lens.tolist()))


_INT64_MAX = np.iinfo(np.int64).max


def _token_array(tokens, j: int) -> np.ndarray:
    """A request's token ids as a 1-D integer ndarray; BatchError naming the request for
    anything else (ragged or nested lists, floats, strings, bools, objects)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise BatchError(f"request {j}: tokens must be a 1-D sequence of integer ids, got a {tokens.dtype} tensor")
        t = tokens.detach().cpu().numpy()
    else:
        try:
            t = np.asarray(tokens)
        except (ValueError, TypeError, OverflowError) as e:  # ragged lists, unconvertible items
            raise BatchError(f"request {j}: tokens must be a 1-D sequence of integer ids ({e})") from None
    if t.ndim != 1 or (t.size and t.dtype.kind not in "iu"):
        raise BatchError(f"request {j}: tokens must be a 1-D sequence of integer ids, got {t.dtype} {t.shape}")
    if t.dtype.kind == "u" and t.size and int(t.max()) > _INT64_MAX:  # would wrap to negative ids
        p = int(np.argmax(t > _INT64_MAX))
        raise BatchError(f"request {j}, position {p}: token id {int(t[p])} is outside the vocabulary")
    return t
