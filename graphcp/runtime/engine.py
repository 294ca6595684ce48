"""PrefillEngine: requests -> prepared batch -> graph replay | eager body -> outputs.

SPMD: every rank of the CP group calls :meth:`PrefillEngine.prefill` with the
same batch. One batch's path: the :class:`BatchPreparer` validates, plans and
reserves it (``graphcp/runtime/batch.py``); the :class:`GraphRunner` replays its bucket, or
says why it runs eagerly and the :class:`Body` runs it; the engine turns the body's
rows into logits (the last-token rows combined across ranks, so every rank returns
the same first-token logits).

Under pipeline parallelism (``ParallelConfig.pp_size > 1``) every rank of every
stage calls ``prefill`` with the same batch; each rank runs its stage's layers on
its CP-local rows, micro-batch by micro-batch (``graphcp/runtime/pp/``), and the outputs
are broadcast from the stages that hold them, so every rank returns the same
``PrefillOutput``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from graphcp.attention.base import AttentionSpec
from graphcp.attention.registry import make_attention, preferred_kv_layout
from graphcp.attention.registry import resolve as resolve_attention
from graphcp.attention.ring.attention import RINGS, RingAttention
from graphcp.attention.ring.hardware import HardwareSpec
from graphcp.attention.ring.plan import RingPlanner
from graphcp.checks import check_int, check_layer_list
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings
from graphcp.config import MAX_MICROBATCHES, ParallelConfig, RuntimeConfig
from graphcp.cp import Plan, make_layout
from graphcp.dist import CPGroup
from graphcp.errors import BatchError, ConfigError, InputError
from graphcp.kv.layer_split import LayerSplitKVCache
from graphcp.kv.paged import KVHandle, PagedKVCache
from graphcp.kv.sharded import make_kv_cache
from graphcp.model.dsa import runtime as dsa_runtime
from graphcp.model.dsv4 import runtime as dsv4_runtime
from graphcp.model.eagle3.checkpoint import load_draft
from graphcp.model.forward_context import KV_RECEIVED, AuxCapture
from graphcp.mesh import build_mesh
from graphcp.model.communicator import LayerCommunicator
from graphcp.model.config import ModelConfig
from graphcp.model.loader import load_model
from graphcp.model.presets import resolve_model
from graphcp.nvtx_ranges import nvtx_range
from graphcp.pd.dsv4_export import DsV4Export, DsV4Meta, dsv4_meta
from graphcp.pd.dsv4_source import export_source as dsv4_export_source
from graphcp.pd.export import KVExport, KVMeta, assemble, gather_stages
from graphcp.pd.fingerprint import model_fingerprint
from graphcp.pd.heads import gather_heads, shard_meta
from graphcp.pd.mla_export import MlaExport, MlaMeta, mla_meta
from graphcp.runtime.batch import BatchPreparer, ForwardInfo, PrefillOutput, PreparedBatch, Request, check_draft_next
from graphcp.runtime.body import Body
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.capture.draft_graphs import DraftGraphs
from graphcp.runtime.capture.runner import Fallback, GraphRunner
from graphcp.runtime.dp import DataParallelPrefill, ReplicaHandle, ReplicaOps
from graphcp.runtime.draft import DraftRunner
from graphcp.runtime.pool_size import pool_bytes, pool_pages
from graphcp.runtime.pp.groups import pipeline_groups
from graphcp.runtime.pp.prefill import MicrobatchedPrefill, StageOps, per_request
from graphcp.runtime.stats import HISTORY, forward_entry

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
        group = group or CPGroup()
        self.parallel = parallel or ParallelConfig(cp_size=group.size)
        self.model_dir = resolve_model(model)
        # options that do not combine are refused before any group or weight (graphcp/combinations.py);
        # 'auto' as the device resolves it (a DSA model's: the torch sparse-MLA reference)
        cfg = ModelConfig.from_file(self.model_dir / "config.json")
        cfg.check_combination(rt, self.parallel, "torch" if (cfg.dsa is not None or cfg.dsv4 is not None)
                              and rt.attention == "auto" else
                              resolve_attention(rt.attention, rt.device))
        if self.parallel.pp_size == 1 and self.parallel.world_size != group.size:
            degree = (f"cp_size={self.parallel.cp_size}" if self.parallel.tp_size == self.parallel.cp_size
                      else f"tp_size={self.parallel.tp_size}")
            raise ConfigError(f"ParallelConfig.{degree} but the process group has {group.size} ranks")
        #: the pipeline's groups and links (None without pipeline parallelism)
        self.pipeline = pipeline_groups(group, self.parallel) if self.parallel.pp_size > 1 else None
        #: the mesh's named groups (graphcp.mesh); ``group`` is this rank's CP group (its stage's, under PP)
        self.mesh = (build_mesh(group, self.parallel) if self.pipeline is None
                     else build_mesh(self.pipeline.world, self.parallel, self.pipeline.cp))
        self.group = self.mesh.cp
        self.device = torch.device(rt.device)
        self.dtype = rt.torch_dtype
        self.cfg, self.model = load_model(self.model_dir, self.dtype, self.device, rank=self.mesh.ffn.rank,
                                          parallel=self.parallel, moe=rt.moe,
                                          stage=self.pipeline.stage if self.pipeline is not None else 0,
                                          attn_rank=self.mesh.attn_tp.rank)
        #: the config with this rank's head counts (attention TP): what the cache and backends size by
        self.attn_cfg = self.model.attn_cfg
        self.stage = self.model.stage
        check_layer_list(rt.aux_hidden_layers, "RuntimeConfig.aux_hidden_layers", self.cfg.num_layers)
        self.max_context = self.cfg.max_position_embeddings
        #: the EAGLE-3 draft (RuntimeConfig.draft), its K/V one more cache layer after the target's
        self.draft = self._load_draft()
        self._cache_layers = len(self.stage.layers) + (self.draft is not None)
        self.layout = make_layout(rt.layout, self.parallel.cp_size)
        kv_layout = preferred_kv_layout(rt.attention, self.device)
        num_pages = pool_pages(rt, self.cfg)
        self._check_pool_fits(num_pages)
        self._fingerprint: str | None = None  # the model's, computed on the first export
        self.buckets = buckets or BucketSet()
        self.buckets.check_compatible(self.parallel.cp_size, rt.layout)
        self.sharded = rt.kv_cache == "sharded"
        ring = None
        if self.cfg.dsv4 is not None:  # window, source and entry pools; pooling, indexer and attention
            self.kv, attention = dsv4_runtime.make_cache_and_attention(
                self.attn_cfg, rt, num_pages, self._max_pages_per_seq(num_pages), self.device, self.model.rotary,
                self.stage.layers, self.group.rank, self.group.size)
        elif self.cfg.dsa is not None:  # MLA's latent + indexer-key cache and sparse attention
            self.kv, attention = dsa_runtime.make_cache_and_attention(
                self.cfg, rt, num_pages, self._max_pages_per_seq(num_pages), self.device, self.group.rank,
                self.group.size, self.parallel.stage_layers(self.cfg.num_layers), self.stage.index)
        else:
            self.kv = self._make_kv_cache(num_pages, kv_layout)
            acfg = self.attn_cfg
            spec = AttentionSpec(acfg.num_heads, acfg.num_kv_heads, acfg.head_dim, rt.page_size,
                                 acfg.head_dim ** -0.5, kv_layout)
            limits = self._attention_limits(num_pages)
            try:
                attention = make_attention(rt.attention, spec, self.device, **limits)
                # the ring's steps 1 .. C-1 plan their own metadata (FlashInfer: one float workspace for all)
                ring = RingAttention(lambda: make_attention(rt.attention, spec, self.device, **limits,
                                                            workspace=getattr(attention, "workspace", None)),
                                     self.group, self.device,
                                     tuple(RINGS) if rt.exchange == "auto" else (rt.exchange,)) if self.sharded else None
            except (ValueError, ImportError) as e:  # a backend refusing this model or device, or not installed
                raise ConfigError(f"RuntimeConfig.attention={rt.attention!r}: {e}") from e
        #: what an export reads a request from (graphcp.kv.spans): the cache, or the reader of a V4
        #: cache's state in transformers' terms (it adds the compressors' position biases)
        self.kv_source = self.kv if self.cfg.dsv4 is None else dsv4_export_source(
            self.kv, zip(self.model.stage.layers, self.model.layers), self.cfg.dsv4.sliding_window)
        self.body = Body(self.model, attention, self.kv, self.group, self.device, ring,
                         LayerCommunicator(self.group, self.mesh.attn_tp, self.mesh.ffn, self.mesh.dp))
        #: attention DP: the batch split over the replicas (None without DP)
        self.dp = DataParallelPrefill(self.mesh.coords.dp, self.parallel.dp_size, self.mesh.dp, self.mesh.ffn,
                                      self.device) if self.parallel.dp_size > 1 else None
        self.preparer = BatchPreparer(
            self.layout, self.kv, self.group, self.cfg.vocab_size, self.max_context, self.device,
            rt.check_consistency, rt.max_requests if attention.name in _SIZED_BACKENDS else None,
            RingPlanner(rt.exchange, self.attn_cfg.num_heads, self.attn_cfg.num_kv_heads, self.cfg.head_dim,
                        self.dtype.itemsize, HardwareSpec(rt.peak_tflops, rt.link_gb_per_s)) if self.sharded else None,
            # every stage of a pipeline (every rank of the mesh) must be given the same batch
            consistency_group=self.pipeline.world if self.pipeline is not None else (
                self.mesh.ffn if self.mesh.ffn.size != self.group.size and self.dp is None else None),
        )
        self._forwards: deque[dict] = deque(maxlen=HISTORY)
        self._forwards_seen = 0
        # the graphs copy the draft's input layers out with the asked auxiliary ones
        self._draft_aux = () if self.draft is None else tuple(
            dict.fromkeys(i for i in self.draft.aux_layer_ids if i not in rt.aux_hidden_layers))
        self.runner = None if rt.graph == "off" else GraphRunner(
            self.body, self.preparer, self.buckets,
            replace(rt, aux_hidden_layers=rt.aux_hidden_layers + self._draft_aux), self.max_context)
        self.drafter = None if self.draft is None else DraftRunner(
            self.draft, self.body, self.group, self.device,
            None if self.runner is None else DraftGraphs(self.draft, self.runner))
        #: the token each live sequence's last draft row took (a chunk extending it must start with it)
        self._draft_next: dict[int, int] = {}
        self.microbatched = MicrobatchedPrefill(
            self.preparer, self.kv, self.stage, self.pipeline, self.parallel.stage_layers(self.cfg.num_layers),
            self.cfg.hidden_size, self.cfg.vocab_size, self.dtype, self.device, self.model.handoff_size)

    def _load_draft(self):
        """The draft of RuntimeConfig.draft (None without one; what it does not combine with was
        refused with the other options: pipeline stages, DSA targets, graphcp/combinations.py)."""
        rt = self.runtime
        if rt.draft is None:
            return None
        return load_draft(rt.draft, self.cfg, self.model.embed_tokens, self.dtype, self.device, self.max_context)

    def _max_pages_per_seq(self, num_pages: int) -> int:
        """A request's page-table width: no request outgrows the model's context
        (prefill checks it before extend), nor the pool."""
        return min(num_pages - 1, -(-self.max_context // self.runtime.page_size))

    def _make_kv_cache(self, num_pages: int, kv_layout) -> PagedKVCache:
        rt, cfg = self.runtime, self.attn_cfg  # a rank's cache holds its own KV heads
        max_pages = self._max_pages_per_seq(num_pages)
        if rt.kv_cache == "layer-split":  # a stage splits its own layers over its CP ranks
            return LayerSplitKVCache(self._cache_layers, num_pages, rt.page_size, cfg.num_kv_heads, cfg.head_dim,
                                     self.dtype, self.device, kv_layout, max_pages, rank=self.group.rank,
                                     cp_size=self.group.size, first_layer=self.stage.layers.start)
        # sharded: this rank's pool of the token-sharded cache (kv_tokens is one rank's); a
        # pipeline stage caches its own layers
        return make_kv_cache(self.sharded, self.group.size, self.group.rank, self._cache_layers, num_pages,
                             rt.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device, kv_layout,
                             max_pages_per_seq=max_pages, first_layer=self.stage.layers.start)

    def _check_pool_fits(self, num_pages: int) -> None:
        """Refuse a KV pool larger than the device's memory up front (a clear error,
        not an allocator failure or the OOM killer halfway through zeroing it)."""
        rt, cfg = self.runtime, self.attn_cfg
        layers = range(self.stage.layers.start, self.stage.layers.start + self._cache_layers)  # the draft's too
        need = pool_bytes(cfg, rt, num_pages, layers, self.group.rank, self.group.size)
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
        """This rank in its CP group (its stage's, under pipeline stages)."""
        return self.group.rank

    @property
    def world(self) -> CPGroup:
        """Every rank of the run: the pipeline's (stage-major), or the CP group without stages."""
        return self.pipeline.world if self.pipeline is not None else self.group

    @property
    def world_rank(self) -> int:
        return self.world.rank

    @property
    def attention(self):
        return self.body.attention

    def capture(self, progress: bool = False):
        """Capture every bucket (graph mode); returns per-bucket capture stats."""
        if self.runner is None:
            raise ConfigError("RuntimeConfig.graph='off': there is nothing to capture")
        out = self.runner.capture_all(progress=progress)
        if self.drafter is not None:  # the draft's graph of every bucket, after the target's
            for cap in sorted(self.runner.graphs, reverse=True):
                self.drafter.graphs.capture(cap)
        return out

    def release(self, handle: KVHandle | ReplicaHandle) -> None:
        """Free a handle's KV pages; KVHandleError (a BatchError) for a handle that is
        not live here (released already, or from another engine). Under attention DP
        (a ReplicaHandle) the replica that holds it frees it."""
        if isinstance(handle, ReplicaHandle):
            if handle.local is not None:
                self.kv.release(handle.local)
            return
        self.kv.release(handle)
        self._draft_next.pop(handle.seq_id, None)

    def kv_meta(self, handle: KVHandle) -> KVMeta | MlaMeta | DsV4Meta:
        """The export metadata of one request's KV (graphcp.pd.export; a DSA model's:
        graphcp.pd.mla_export; a DeepSeek V4 model's: graphcp.pd.dsv4_export)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model_dir)
        cfg = self.cfg
        if cfg.dsv4 is not None:
            return dsv4_meta(cfg, handle.num_tokens, self.runtime.dtype, self.runtime.page_size, self._fingerprint)
        if cfg.dsa is not None:
            return mla_meta(cfg, handle.num_tokens, self.runtime.dtype, self.runtime.page_size, self._fingerprint)
        drafts = int(self.draft is not None)  # the draft's layer follows the target's
        return KVMeta(handle.num_tokens, cfg.num_layers + drafts, cfg.num_kv_heads, cfg.head_dim, self.runtime.dtype,
                      self.runtime.page_size, self._fingerprint, draft_layers=drafts)

    @torch.inference_mode()
    def export_kv(self, handle: KVHandle, dst: int | None = None) -> KVExport | MlaExport | DsV4Export | None:
        """One request's KV in the transport-neutral layout of graphcp.pd.export: every
        layer's K and V, ``[num_kv_heads, num_tokens, head_dim]``, keys after RoPE (a DSA
        model: latent, rope key and indexer key, graphcp.pd.mla_export; a DeepSeek V4
        model: transformers' cache state, graphcp.pd.dsv4_export, read by every rank
        that receives from its replicated cache). Every
        rank calls it (like prefill); ``dst`` is the rank that gets the export (the others
        get None), None: every rank. Each rank contributes the spans its cache mode holds;
        only this request's KV moves. Releases nothing (``release`` stays explicit);
        KVHandleError for a handle that is not live here.

        Under pipeline stages every rank of every stage calls it and ``dst`` is a rank of
        the whole pipeline (stage-major, as ``torch.distributed`` numbers them): each
        stage's CP group assembles its own layers, then each stage's layers travel to the
        receivers in one message (graphcp.pd.export.gather_stages)."""
        check_combination({**parallel_settings(self.parallel), "export": "on"})
        self.kv.check_handle(handle)
        world = self.world
        if dst is not None:
            check_int(dst, "export_kv: dst (the rank that receives the export)", lo=0, hi=world.size - 1,
                      err=InputError)
        spans = self.kv_source.kv_spans(handle, self.group.size)
        meta = self.kv_meta(handle)
        C = self.group.size  # without stages dst % C is dst
        if self.mesh.attn_tp.size > 1 and self.cfg.dsv4 is None:
            # each shard over CP, every rank receiving; then the heads over attention TP (V4's one KV
            # head is replicated over attention TP: every rank's cache holds it whole)
            out = assemble(self.kv, handle, spans, self.group, shard_meta(meta, self.attn_cfg.num_kv_heads), None,
                           self.device)
            gather_heads(out, self.mesh.attn_tp, meta.num_kv_heads)
            C = self.mesh.ffn.size  # every rank of a stage holds the export now
        else:
            out = assemble(self.kv_source, handle, spans, self.group, meta, None if dst is None else dst % C,
                           self.device)
        if self.pipeline is not None:
            stage_layers = self.parallel.stage_layers(self.cfg.num_layers)
            gather_stages(out, meta, stage_layers, self.pipeline.stage, world, C, dst, self.device)
        return meta.make_export(out) if dst is None or world.rank == dst else None

    def export_kv_batch(self, handles: Sequence[KVHandle],
                        dst: int | None = None) -> list[KVExport | MlaExport | DsV4Export | None]:
        """:meth:`export_kv` for each handle, in order (all handles checked first)."""
        for h in handles:
            self.kv.check_handle(h)
        return [self.export_kv(h, dst) for h in handles]

    @torch.inference_mode()
    def prefill(self, batch: Sequence[Request], all_logits: bool = False, force_eager: bool = False,
                microbatches: int | None = None,
                aux_hidden_layers: Sequence[int] | None = None,
                draft_next: Sequence[int | None] | None = None) -> PrefillOutput:
        """Prefill one batch (the same on every rank); ``force_eager`` skips the graphs.

        ``microbatches``: pipeline the batch as this many micro-batches (default
        ``RuntimeConfig.microbatches``; see ``graphcp/runtime/pp/microbatch.py``).
        ``aux_hidden_layers``: the decoder layers whose output hidden states to return
        per request (``PrefillOutput.aux_hidden``; default
        ``RuntimeConfig.aux_hidden_layers``; with graphs, a subset of those).
        ``draft_next`` (an engine with ``RuntimeConfig.draft``): per request the token
        after its new tokens, the last draft row's input: the next prompt token when
        a prompt is prefilled in chunks, or the caller's sample; None (the default,
        or an entry): the target's greedy token (docs/speculative.md)."""
        with nvtx_range("prefill", category="forward"):  # the top-level range profiles measure against
            t0 = time.perf_counter()
            m = self._microbatches(microbatches)
            aux = self._aux_layers(aux_hidden_layers)
            call = (int(bool(all_logits)), int(bool(force_eager)), m, len(aux), *aux)
            nxt = self._draft_next_tokens(batch, draft_next, m)
            if nxt is not None:
                call += (len(nxt), *nxt.tolist())
            if self.dp is not None:
                if m != 1:
                    raise BatchError(f"prefill: microbatches={m} under attention DP is not built yet (use 1)")
                out = self.dp.run(batch, self._replica_ops(all_logits, force_eager, aux, call), all_logits)
            elif self.drafter is not None:
                out = self._prefill_once(batch, all_logits, force_eager, aux, call, nxt)
            elif self.pipeline is None and m == 1:
                out = self._prefill_once(batch, all_logits, force_eager, aux, call)
            else:
                ops = StageOps(lambda prep, rows: self._recorded_stage_rows(prep, rows, force_eager, aux),
                               self._last_logits, self._all_logits, self._aux_gather)
                out = self.microbatched.run(batch, ops, m, call, all_logits, aux)
            out.info.timings["total_s"] = time.perf_counter() - t0
            return out

    def _draft_next_tokens(self, batch, given, m: int) -> np.ndarray | None:
        """The checked ``draft_next`` (-1: the target's greedy token), or None without a
        draft (graphcp/runtime/batch.py: :func:`check_draft_next`)."""
        return check_draft_next(batch, given, m, drafting=self.drafter is not None, vocab_size=self.cfg.vocab_size,
                                draft_tokens=self._draft_next, cache_id=self.kv.cache_id)

    def _microbatches(self, m: int | None) -> int:
        if m is None:
            return self.runtime.microbatches
        return check_int(m, "microbatches", lo=1, hi=MAX_MICROBATCHES, where="prefill", err=InputError)

    def _aux_layers(self, layers: Sequence[int] | None) -> tuple[int, ...]:
        """The layers a call asks for, checked (nothing has changed when this raises)."""
        rt = self.runtime
        if layers is None:
            return rt.aux_hidden_layers
        layers = check_layer_list(layers, "prefill: aux_hidden_layers", self.cfg.num_layers, err=BatchError)
        missing = [i for i in layers if i not in rt.aux_hidden_layers]
        if self.runner is not None and missing:
            raise BatchError(
                f"prefill: aux_hidden_layers asks for layer {missing[0]}, which the graphs do not copy "
                f"(RuntimeConfig.aux_hidden_layers={list(rt.aux_hidden_layers)}, graph={rt.graph!r}): "
                "a captured graph copies the layers fixed when the engine is built; add it there"
            )
        return layers

    def _prefill_once(self, batch, all_logits: bool, force_eager: bool, aux: tuple[int, ...],
                      call: tuple[int, ...], draft_next: np.ndarray | None = None) -> PrefillOutput:
        prep = self.preparer.prepare(batch, call_args=call)
        draft = None
        try:
            # the draft's input layers ride with the asked ones (graphs copy both)
            extra = () if self.drafter is None else tuple(i for i in self.draft.aux_layer_ids if i not in aux)
            hidden, info, aux_rows = self._stage_rows(prep, None, force_eager, aux + tuple(dict.fromkeys(extra)))
            info.timings["plan_s"] = prep.plan_s
            info.stats.update(self.body.attention.forward_stats(prep.plan.prefix_lens, prep.plan.extend_lens))
            with nvtx_range("lm_head", category="output"):
                last_logits = self._last_logits(prep.plan, hidden)
                logits = self._all_logits(prep.plan, hidden) if all_logits else None
            if self.drafter is not None:
                draft = self._run_draft(prep, batch, aux + tuple(dict.fromkeys(extra)), aux_rows, last_logits,
                                        draft_next, all_logits, info)
            aux_hidden = self._aux_gather(prep.plan, aux_rows[:, :len(aux)]) if aux else None
        except BaseException:
            self.preparer.abort(prep)
            raise
        self._record(prep, info)
        ext = prep.plan.extend_lens.tolist()
        if draft is not None:
            self._draft_next.update(zip(prep.seq_ids, draft.next_tokens.tolist()))
        return PrefillOutput(last_logits, [self.kv.handle(s) for s in prep.seq_ids],
                             None if logits is None else list(torch.split(logits, ext)), info,
                             None if aux_hidden is None else per_request(aux_hidden, ext), draft)

    def _run_draft(self, prep: PreparedBatch, batch, layers: tuple[int, ...], aux_rows: torch.Tensor,
                   last_logits: torch.Tensor, draft_next: np.ndarray, all_logits: bool, info: ForwardInfo):
        """The draft over this rank's rows (graphcp.runtime.draft): its inputs the target's
        rows of its layers, in the checkpoint's order, and the batch's shifted ids."""
        nxt = np.where(draft_next >= 0, draft_next, last_logits.argmax(dim=-1).numpy())  # greedy by default
        flat = np.concatenate([np.asarray(r.tokens, dtype=np.int64).reshape(-1) for r in batch])
        if info.path == "graph":  # the draft's graph reads the bucket's static rows
            return self.drafter.run(prep, flat, None, nxt, all_logits, info.stats, info.capacity)
        cols = torch.tensor([layers.index(i) for i in self.draft.aux_layer_ids], device=self.device)
        hidden = aux_rows.index_select(1, cols).flatten(1)  # [rows, 3 * hidden]: fc's input, this rank's rows
        return self.drafter.run(prep, flat, hidden, nxt, all_logits, info.stats)

    def _replica_ops(self, all_logits: bool, force_eager: bool, aux: tuple[int, ...],
                     call: tuple[int, ...]) -> ReplicaOps:
        """How an attention-DP replica runs its share of a batch (graphcp.runtime.dp)."""
        def outputs(prep, hidden, info, aux_rows, all_logits):
            ext = prep.plan.extend_lens.tolist()
            last = self._last_logits(prep.plan, hidden)
            logits = list(torch.split(self._all_logits(prep.plan, hidden), ext)) if all_logits else None
            rows = self._aux_gather(prep.plan, aux_rows) if aux else None
            return last, logits, None if rows is None else per_request(rows, ext)

        return ReplicaOps(
            prepare=lambda sub: self.preparer.prepare(sub, call_args=call),
            abort=self.preparer.abort,
            forward=lambda prep, rows: self._stage_rows(prep, None, force_eager, aux, rows),
            outputs=outputs, handle=self.kv.handle, record=self._record)

    # ---- stats ------------------------------------------------------------------
    def _record(self, prep: PreparedBatch, info: ForwardInfo) -> None:
        """The forward's figures into its ForwardInfo.stats, and the entry into the history."""
        st = info.stats
        ring = prep.ring
        st["exchange"] = "all-gather" if ring is None else ring.exchange
        st["new_tokens"] = prep.plan.num_tokens
        st["cached_tokens"] = int(prep.plan.prefix_lens.sum())
        st[KV_RECEIVED] = st.get(KV_RECEIVED, 0)
        st["bytes_received_per_layer"] = st[KV_RECEIVED] // len(self.stage.layers)
        if ring is not None and ring.choice is not None:
            st["exchange_choice"] = ring.choice.as_dict()
        self._forwards.append(forward_entry(info))
        self._forwards_seen += 1

    def stats(self) -> dict:
        """What this rank did (the shape is documented in :mod:`graphcp.runtime.stats`; the
        stats file lists every rank's)."""
        kv = self.kv
        return {
            "rank": self.rank, "cp_size": self.group.size, "world_rank": self.world_rank,
            # the mesh: this rank's (dp, cp, attn_tp) coordinates, the degrees, the KV heads it stores
            "mesh": self.mesh.coords.as_dict(), "tp_size": self.parallel.tp_size,
            "attn_tp_size": self.parallel.attn_tp_size, "dp_size": self.parallel.dp_size,
            "kv_heads": self.attn_cfg.num_kv_heads,
            "stage": 0 if self.pipeline is None else self.pipeline.stage,
            "layers": [self.stage.layers.start, self.stage.layers.stop], "kv_cache": self.runtime.kv_cache,
            "exchange": "all-gather" if not self.sharded else self.runtime.exchange,
            "kv_pool_tokens": (kv.num_pages - 1) * kv.page_size,
            "kv_pool_bytes": kv.pool_bytes,  # every page pool (MLA: latent and indexer keys)
            # each pool's bytes (V4: window, source rows and entries of each layer kind)
            "kv_pools": {name: t.numel() * t.element_size() for name, t in kv.page_pools().items()},
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
    def _stage_rows(self, prep: PreparedBatch, hidden_in: torch.Tensor | None, force_eager: bool,
                    aux: tuple[int, ...], rows: int | None = None) -> tuple[torch.Tensor, ForwardInfo, torch.Tensor | None]:
        """This rank's body output rows, replayed from the bucket's graph or eager, its
        info, and the rows of the asked auxiliary layers this stage holds ([rows,
        n, hidden] in the asked order; None when it holds none). ``rows``: the rows the
        forward must hold (attention DP: the largest replica's; default this batch's)."""
        mine = tuple(i for i in aux if i in self.stage.layers)
        required = rows or prep.plan.max_local_rows
        fallback = None
        if self.runner is not None and not force_eager:
            outcome = self.runner.try_replay(prep, hidden_in, rows)
            if not isinstance(outcome, Fallback):
                hidden, info = outcome
                info.stats.update(prep.stats)
                if not mine:
                    return hidden, info, None
                cols = torch.tensor([self.runner.aux_layers.index(i) for i in mine], device=self.device)
                # a copy: the static rows are overwritten by the next replay
                return hidden, info, self.runner.aux_rows(info.capacity).index_select(1, cols)
            fallback = outcome.reason
        capture = None
        if mine:
            rows = torch.empty(required, len(mine), self.cfg.hidden_size, dtype=self.dtype, device=self.device)
            capture = AuxCapture(mine, rows)
        hidden = self.body.eager(prep, required, hidden_in, capture)
        info = ForwardInfo("eager", required, required, fallback)
        info.stats.update(prep.stats)
        return hidden, info, None if capture is None else capture.out

    def _recorded_stage_rows(self, prep: PreparedBatch, hidden_in: torch.Tensor | None, force_eager: bool,
                             aux: tuple[int, ...]) -> tuple[torch.Tensor, ForwardInfo, torch.Tensor | None]:
        """:meth:`_stage_rows` of one micro-batch (or one stage's forward), its figures
        recorded as a forward of its own (the exchange it ran, the bytes it received)."""
        hidden, info, aux_rows = self._stage_rows(prep, hidden_in, force_eager, aux)
        self._record(prep, info)
        return hidden, info, aux_rows

    def _last_logits(self, plan: Plan, hidden: torch.Tensor) -> torch.Tensor:
        mine = np.flatnonzero(plan.last_owner == self.rank)
        rows = torch.zeros(plan.num_requests, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        if mine.size:
            idx = torch.from_numpy(plan.last_local_index[mine]).to(hidden.device)
            rows[torch.from_numpy(mine).to(hidden.device)] = hidden.index_select(0, idx)
        # every other rank contributes zeros: the sum is exactly the owner's rows
        self.group.all_reduce_(rows)
        return self.model.logits(rows).cpu()

    def _in_batch_order(self, plan: Plan, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's local rows (padded to the same count), gathered over the CP
        group and put in batch order: [T, ...]."""
        everyone = self.group.all_gather_rows(rows.contiguous())
        return everyone.index_select(0, torch.from_numpy(plan.gather_index(rows.shape[0])).to(rows.device))

    def _all_logits(self, plan: Plan, hidden: torch.Tensor) -> torch.Tensor:
        """Every new token's logits, float32 [T, vocab] in batch order."""
        return self.model.logits(self._in_batch_order(plan, hidden)).cpu()

    def _aux_gather(self, plan: Plan, rows: torch.Tensor | None) -> torch.Tensor | None:
        """This stage's auxiliary rows in batch order, float32 [T, n, hidden] (the
        inverse of the CP layout's permutation); None when it holds none."""
        if rows is None:
            return None
        with nvtx_range("aux_hidden", category="output"):
            return self._in_batch_order(plan, rows).float().cpu()


def prefill_prefixes(engine: PrefillEngine, prefixes: Sequence[object | None],
                     next_tokens: Sequence[int] | None = None) -> list[KVHandle | None]:
    """Prefill the given prefixes (token ids; None for a request without one) in one
    forward: the handles a batch of chunked requests then extends. ``next_tokens``: the
    token that follows each prefix (its draft's last row takes it: an engine with a draft)."""
    idx = [i for i, p in enumerate(prefixes) if p is not None]
    handles: list[KVHandle | None] = [None] * len(prefixes)
    if idx:
        kw = {} if engine.draft is None else {"draft_next": None if next_tokens is None else
                                              [int(next_tokens[i]) for i in idx]}
        for i, h in zip(idx, engine.prefill([Request(prefixes[i]) for i in idx], aux_hidden_layers=(),
                                            **kw).handles):
            handles[i] = h
    return handles


def prefill_after_prefixes(engine: PrefillEngine, batch: Sequence[tuple[object | None, object]],
                           all_logits: bool = False, **prefill_args) -> PrefillOutput:
    """Prefill ``(prefix tokens or None, new tokens)`` requests the way a chunked
    prefill sees them: every cached prefix first (one forward), then the new tokens
    extending them (one forward, with ``prefill_args``: micro-batches, auxiliary
    layers). On failure the prefixes are released."""
    handles = prefill_prefixes(engine, [p for p, _ in batch], [np.asarray(new).reshape(-1)[0] for _, new in batch])
    try:
        return engine.prefill([Request(new, h) for (_, new), h in zip(batch, handles)], all_logits=all_logits,
                              **prefill_args)
    except BaseException:
        for h in handles:
            if h is not None:
                engine.release(h)
        raise
