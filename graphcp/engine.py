"""PrefillEngine: requests -> prepared batch -> graph replay | eager body -> outputs.

SPMD: every rank of the CP group calls :meth:`PrefillEngine.prefill` with the
same batch. One batch's path: the :class:`BatchPreparer` validates, plans and
reserves it (``graphcp/batch.py``); the :class:`GraphRunner` replays its bucket, or
says why it runs eagerly and the :class:`Body` runs it; the engine turns the body's
rows into logits (the last-token rows combined across ranks, so every rank returns
the same first-token logits).
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from graphcp.attention.base import AttentionSpec
from graphcp.attention.hardware import HardwareSpec
from graphcp.attention.registry import make_attention, preferred_kv_layout
from graphcp.attention.ring import RingAttention
from graphcp.attention.ring_plan import RingPlanner
from graphcp.batch import BatchPreparer, ForwardInfo, PrefillOutput, PreparedBatch, Request
from graphcp.body import Body
from graphcp.capture.buckets import BucketSet
from graphcp.capture.runner import Fallback, GraphRunner
from graphcp.config import ConfigError, ParallelConfig, RuntimeConfig
from graphcp.cp import Plan, make_layout
from graphcp.dist import CPGroup
from graphcp.forward_context import KV_RECEIVED
from graphcp.kv_sharded import make_kv_cache
from graphcp.kvcache import KVHandle, PagedKVCache
from graphcp.layer_split import LayerSplitKVCache, pool_layers
from graphcp.model.loader import load_model
from graphcp.model.presets import resolve_model
from graphcp.pd.export import KVExport, KVMeta, assemble
from graphcp.pd.fingerprint import model_fingerprint
from graphcp.profile.ranges import nvtx_range
from graphcp.stats import HISTORY, forward_entry

#: kernel backends that preallocate per request: a batch may hold at most max_requests
_SIZED_BACKENDS = ("flashinfer", "trtllm")


class PrefillEngine:
    def __init__(
        self,
        model: str | Path = "default",
        runtime: RuntimeConfig | None = None,
        group: CPGroup | None = None,
        buckets: BucketSet | None = None,
        parallel: ParallelConfig | None = None,
    ) -> None:
        self.runtime = rt = runtime or RuntimeConfig()
        self.group = group or CPGroup()
        self.parallel = parallel or ParallelConfig(cp_size=self.group.size)
        if self.parallel.cp_size != self.group.size:
            raise ConfigError(f"ParallelConfig.cp_size={self.parallel.cp_size} but the process group has "
                              f"{self.group.size} ranks")
        self.device = torch.device(rt.device)
        self.dtype = rt.torch_dtype
        self.model_dir = resolve_model(model)
        self.cfg, self.model = load_model(self.model_dir, self.dtype, self.device, rank=self.group.rank,
                                          tp_size=self.parallel.tp_size, moe=rt.moe)
        self.max_context = self.cfg.max_position_embeddings
        self.layout = make_layout(rt.layout, self.parallel.cp_size)
        kv_layout = preferred_kv_layout(rt.attention, self.device)
        kv_tokens = rt.kv_tokens if rt.kv_tokens is not None else min(4 * self.cfg.max_position_embeddings, 1 << 16)
        num_pages = -(-kv_tokens // rt.page_size) + 1  # + the scratch page
        self._check_pool_fits(num_pages)
        self.sharded = rt.kv_cache == "sharded"
        self.kv = self._make_kv_cache(num_pages, kv_layout)
        self._fingerprint: str | None = None  # the model's, computed on the first export
        spec = AttentionSpec(
            self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, rt.page_size,
            self.cfg.head_dim ** -0.5, kv_layout,
        )
        self.buckets = buckets or BucketSet()
        self.buckets.check_compatible(self.parallel.cp_size, rt.layout)
        limits = self._attention_limits(num_pages)
        try:
            attention = make_attention(rt.attention, spec, self.device, **limits)
            # the ring's steps 1 .. C-1 plan their own metadata (FlashInfer: one float workspace for all)
            ring = RingAttention(lambda: make_attention(rt.attention, spec, self.device, **limits,
                                                        workspace=getattr(attention, "workspace", None)),
                                 self.group, self.device) if self.sharded else None
        except (ValueError, ImportError) as e:  # a backend refusing this model or device, or not installed
            raise ConfigError(f"RuntimeConfig.attention={rt.attention!r}: {e}") from e
        self.body = Body(self.model, attention, self.kv, self.group, self.device, ring)
        self.preparer = BatchPreparer(
            self.layout, self.kv, self.group, self.cfg.vocab_size, self.max_context, self.device,
            rt.check_consistency, rt.max_requests if attention.name in _SIZED_BACKENDS else None,
            RingPlanner(rt.exchange, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim,
                        self.dtype.itemsize, HardwareSpec(rt.peak_tflops, rt.link_gb_per_s)) if self.sharded else None,
        )
        self._forwards: deque[dict] = deque(maxlen=HISTORY)
        self._forwards_seen = 0
        self.runner = None if rt.graph == "off" else GraphRunner(
            self.body, self.preparer, self.buckets, rt, self.max_context)

    def _make_kv_cache(self, num_pages: int, kv_layout) -> PagedKVCache:
        rt, cfg = self.runtime, self.cfg
        args = (cfg.num_layers, num_pages, rt.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
                kv_layout,
                # no request outgrows the model's context (prefill checks it before extend)
                min(num_pages - 1, -(-self.max_context // rt.page_size)))
        if rt.kv_cache == "layer-split":
            return LayerSplitKVCache(*args, rank=self.group.rank, cp_size=self.group.size)
        # sharded: this rank's pool of the token-sharded cache (kv_tokens is one rank's)
        return make_kv_cache(self.sharded, self.group.size, self.group.rank, *args)

    def _pool_layers(self) -> int:
        """Layers this rank's pool holds (LayerSplit: its own and one scratch layer)."""
        if self.runtime.kv_cache == "layer-split":
            return pool_layers(self.cfg.num_layers, self.group.rank, self.group.size)
        return self.cfg.num_layers

    def _check_pool_fits(self, num_pages: int) -> None:
        """Refuse a KV pool larger than the device's memory up front (a clear error,
        not an allocator failure or the OOM killer halfway through zeroing it)."""
        rt, cfg = self.runtime, self.cfg
        need = self._pool_layers() * num_pages * 2 * rt.page_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
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
                f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB {self.device.type} memory (lower RuntimeConfig.kv_tokens)"
            )

    def _attention_limits(self, num_pages: int) -> dict:
        """Static sizes the kernel backends preallocate for (each takes what it needs)."""
        rt, C = self.runtime, self.parallel.cp_size
        if rt.layout == "interleave" and rt.attention in _SIZED_BACKENDS:
            raise ConfigError(
                f"RuntimeConfig.attention={rt.attention!r} runs the zigzag layout; interleave's one-row segments "
                "make its batch as large as the rank's rows (use attention='torch' or 'triton' with interleave)"
            )
        # a rank's rows hold its share of the pool's tokens (all of them: a sharded pool is its own)
        pool_rows = num_pages * rt.page_size if rt.kv_cache == "sharded" else -(-num_pages * rt.page_size // C)
        max_rows = max(self.buckets.largest, pool_rows)
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

    @property
    def attention(self):
        return self.body.attention

    def capture(self, progress: bool = False):
        """Capture every bucket (graph mode); returns per-bucket capture stats."""
        if self.runner is None:
            raise ConfigError("RuntimeConfig.graph='off': there is nothing to capture")
        return self.runner.capture_all(progress=progress)

    def release(self, handle: KVHandle) -> None:
        """Free a handle's KV pages; KVHandleError (a BatchError) for a handle that is
        not live here (released already, or from another engine)."""
        self.kv.release(handle)

    def kv_meta(self, handle: KVHandle) -> KVMeta:
        """The export metadata of one request's KV (graphcp.pd.export)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model_dir)
        cfg = self.cfg
        return KVMeta(handle.num_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.runtime.dtype,
                      self.runtime.page_size, self._fingerprint)

    @torch.inference_mode()
    def export_kv(self, handle: KVHandle, dst: int | None = None) -> KVExport | None:
        """One request's KV in the transport-neutral layout of graphcp.pd.export: every
        layer's K and V, ``[num_kv_heads, num_tokens, head_dim]``, keys after RoPE. Every
        rank calls it (like prefill); ``dst`` is the rank that gets the export (the others
        get None), None: every rank. Each rank contributes the spans its cache mode holds;
        only this request's KV moves. Releases nothing (``release`` stays explicit);
        KVHandleError for a handle that is not live here."""
        self.kv.check_handle(handle)
        spans = self.kv.kv_spans(handle, self.group.size)
        return assemble(self.kv, handle, spans, self.group, self.kv_meta(handle), dst, self.device)

    def export_kv_batch(self, handles: Sequence[KVHandle], dst: int | None = None) -> list[KVExport | None]:
        """:meth:`export_kv` for each handle, in order (all handles checked first)."""
        for h in handles:
            self.kv.check_handle(h)
        return [self.export_kv(h, dst) for h in handles]

    @torch.inference_mode()
    def prefill(self, batch: Sequence[Request], all_logits: bool = False, force_eager: bool = False) -> PrefillOutput:
        """Prefill one batch (the same on every rank); ``force_eager`` skips the graphs."""
        with nvtx_range("prefill", category="forward"):  # the top-level range profiles measure against
            t0 = time.perf_counter()
            prep = self.preparer.prepare(batch)
            try:
                hidden, info = self._body_rows(prep, force_eager)
                info.timings["plan_s"] = prep.plan_s
                info.stats.update(prep.stats)
                with nvtx_range("lm_head", category="output"):
                    last_logits = self._last_logits(prep.plan, hidden)
                    logits = self._all_logits(prep.plan, hidden) if all_logits else None
            except BaseException:
                self.preparer.abort(prep)
                raise
            info.timings["total_s"] = time.perf_counter() - t0
            self._record(prep, info)
            return PrefillOutput(last_logits, [self.kv.handle(s) for s in prep.seq_ids], logits, info)

    # ---- stats ------------------------------------------------------------------
    def _record(self, prep: PreparedBatch, info: ForwardInfo) -> None:
        """The forward's figures into its ForwardInfo.stats, and the entry into the history."""
        st = info.stats
        ring = prep.ring
        st["exchange"] = "all-gather" if ring is None else ring.exchange
        st["new_tokens"] = prep.plan.num_tokens
        st["cached_tokens"] = int(prep.plan.prefix_lens.sum())
        st[KV_RECEIVED] = st.get(KV_RECEIVED, 0)
        st["bytes_received_per_layer"] = st[KV_RECEIVED] // self.cfg.num_layers
        if ring is not None and ring.choice is not None:
            st["exchange_choice"] = ring.choice.as_dict()
        self._forwards.append(forward_entry(info))
        self._forwards_seen += 1

    def stats(self) -> dict:
        """What this rank did (the shape is documented in :mod:`graphcp.stats`; the
        stats file lists every rank's)."""
        kv = self.kv
        return {
            "rank": self.rank, "cp_size": self.group.size, "kv_cache": self.runtime.kv_cache,
            "exchange": "all-gather" if not self.sharded else self.runtime.exchange,
            "kv_pool_tokens": (kv.num_pages - 1) * kv.page_size,
            "kv_pool_bytes": kv.pool.numel() * kv.pool.element_size(),
            "kv_stored_tokens": kv.stored_tokens(),
            "kv_stored_pages": kv.stored_pages(),
            "forwards": list(self._forwards),
            "forwards_dropped": self._forwards_seen - len(self._forwards),
        }

    def reset_stats(self) -> None:
        """Forget the forwards recorded so far."""
        self._forwards.clear()
        self._forwards_seen = 0

    # ---- steps ------------------------------------------------------------------
    def _body_rows(self, prep: PreparedBatch, force_eager: bool) -> tuple[torch.Tensor, ForwardInfo]:
        """This rank's body output rows: replayed from the bucket's graph, or eager."""
        required = prep.plan.max_local_rows
        fallback = None
        if self.runner is not None and not force_eager:
            outcome = self.runner.try_replay(prep)
            if not isinstance(outcome, Fallback):
                return outcome
            fallback = outcome.reason
        return self.body.eager(prep, required), ForwardInfo("eager", required, required, fallback)

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


def prefill_prefixes(engine: PrefillEngine, prefixes: Sequence[object | None]) -> list[KVHandle | None]:
    """Prefill the given prefixes (token ids; None for a request without one) in one
    forward: the handles a batch of chunked requests then extends."""
    idx = [i for i, p in enumerate(prefixes) if p is not None]
    handles: list[KVHandle | None] = [None] * len(prefixes)
    if idx:
        for i, h in zip(idx, engine.prefill([Request(prefixes[i]) for i in idx]).handles):
            handles[i] = h
    return handles


def prefill_after_prefixes(engine: PrefillEngine, batch: Sequence[tuple[object | None, object]],
                           all_logits: bool = False) -> PrefillOutput:
    """Prefill ``(prefix tokens or None, new tokens)`` requests the way a chunked
    prefill sees them: every cached prefix first (one forward), then the new tokens
    extending them (one forward). On failure the prefixes are released."""
    handles = prefill_prefixes(engine, [p for p, _ in batch])
    try:
        return engine.prefill([Request(new, h) for (_, new), h in zip(batch, handles)], all_logits=all_logits)
    except BaseException:
        for h in handles:
            if h is not None:
                engine.release(h)
        raise
