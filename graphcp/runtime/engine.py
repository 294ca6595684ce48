"""PrefillEngine: requests -> prepared batch -> graph replay | eager body -> outputs.

SPMD: every rank of the CP group calls :meth:`PrefillEngine.prefill` with the
same batch. The engine wires its parts (``graphcp/runtime/build.py``: the model its
family builds, the cache of the cache mode, the attention, the body, the preparer,
the graphs) and hands each call to a forward driver (``graphcp/runtime/forward.py``):
one forward, micro-batches through a pipeline stage (``graphcp/runtime/pp/``) or
attention-DP replicas (``graphcp/runtime/dp.py``). One batch's path: the
:class:`BatchPreparer` validates, plans and reserves it (``graphcp/runtime/batch.py``);
the :class:`GraphRunner` replays its bucket, or says why it runs eagerly and the
:class:`Body` runs it; the output head turns the body's rows into logits (the
last-token rows combined across ranks, so every rank returns the same first-token
logits).

Under pipeline parallelism (``ParallelConfig.pp_size > 1``) every rank of every
stage calls ``prefill`` with the same batch; each rank runs its stage's layers on
its CP-local rows, micro-batch by micro-batch, and the outputs are broadcast from
the stages that hold them, so every rank returns the same ``PrefillOutput``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from graphcp.checks import check_int, check_layer_list
from graphcp.config import MAX_MICROBATCHES, ParallelConfig, RuntimeConfig
from graphcp.dist import CPGroup
from graphcp.errors import BatchError, ConfigError, InputError
from graphcp.kv.handle import KVHandle
from graphcp.model.config import ModelConfig
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import DecodeOutput, PrefillOutput, Request
from graphcp.runtime.build import EngineParts, build_parts
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.decode.generate import GenerateOutput, generate, stop_tokens
from graphcp.runtime.dp import DataParallelPrefill, ReplicaHandle
from graphcp.runtime.draft import draft_next_tokens
from graphcp.runtime.export import Exporter
from graphcp.runtime.forward import ForwardDriver, ForwardParts, PrefillCall, SingleForward
from graphcp.runtime.import_kv import Importer
from graphcp.runtime.outputs import OutputHead
from graphcp.runtime.pp.prefill import MicrobatchedPrefill


class PrefillEngine:
    """One rank's engine (see the module doc). Its interface (docs/api.md): the methods
    (``prefill``, ``decode``, ``generate``, ``release``, ``export_kv``, ``export_kv_batch``,
    ``kv_meta``, ``capture``, ``capture_decode``, ``stats``, ``reset_stats``), the run's
    values below, and :attr:`parts`, the one route to each wired part (the cache, the
    preparer, the body and its attention, the graphs, the decode steps, ...)."""

    #: every wired part of this rank's engine (graphcp.runtime.build.EngineParts): the one route to each
    parts: EngineParts
    #: the runtime options and the parallel degrees the engine was built with
    runtime: RuntimeConfig
    parallel: ParallelConfig
    #: the checkpoint folder (a preset's, written on first use)
    model_dir: Path
    #: the model's config (its whole head counts; this rank's: ``parts.attn_cfg``)
    cfg: ModelConfig
    device: torch.device
    #: the model's and the cache's dtype
    dtype: torch.dtype
    #: the longest request the model takes (its max_position_embeddings)
    max_context: int
    #: this rank in its CP group (its stage's, under PP)
    rank: int
    #: every rank of the run (graphcp.mesh numbers them), and this rank in it (export_kv's ``dst``)
    world: CPGroup
    world_rank: int

    def __init__(
        self,
        model: str | Path = "default",
        runtime: RuntimeConfig | None = None,
        group: CPGroup | None = None,
        buckets: BucketSet | None = None,
        parallel: ParallelConfig | None = None,
    ) -> None:
        self.runtime = runtime or RuntimeConfig()
        self.parts = p = build_parts(model, self.runtime, group or CPGroup(), buckets, parallel)
        self.parallel, self.model_dir, self.cfg, self.device = p.parallel, p.model_dir, p.cfg, p.device
        self.dtype, self.max_context = p.runtime.torch_dtype, p.cfg.max_position_embeddings
        self.world = p.world
        self.rank, self.world_rank = p.group.rank, self.world.rank
        # the prefill's drivers, over the one forward (the decode steps' is parts.decoder)
        fw = ForwardParts(p.preparer, p.kv, p.forward, OutputHead(p.model, p.group), p.recorder)
        self._single = SingleForward(fw, p.drafter)
        mesh, stage = p.mesh, p.model.stage
        # attention DP: the batch split over the replicas (None without DP)
        self._dp = DataParallelPrefill(mesh.coords.dp, p.parallel.dp_size, mesh.dp, mesh.ffn, p.device,
                                       fw) if p.parallel.dp_size > 1 else None
        self._microbatched = MicrobatchedPrefill(
            fw, stage, p.pipeline, p.parallel.stage_layers(p.cfg.num_layers), p.cfg.hidden_size, p.cfg.vocab_size,
            p.model.dtype, p.device, p.model.handoff_size)
        self._exporter = Exporter(p)
        self._importer = Importer(p, self._exporter)
        self._decode = p.decoder.decode  # (bound once: a decode step's call)

    # ---- public API -------------------------------------------------------------
    def capture(self, progress: bool = False, up_to: int | None = None):
        """Capture every bucket (graph mode), or those of at most ``up_to`` local rows (a
        larger one is captured when a batch first needs it); returns per-bucket capture
        stats."""
        runner, drafter = self.parts.runner, self.parts.drafter
        if runner is None:
            raise ConfigError("RuntimeConfig.graph='off': there is nothing to capture")
        out = runner.capture_all(progress=progress, up_to=up_to)
        if drafter is not None:  # the draft's graph of every bucket, after the target's
            for cap in sorted(runner.graphs, reverse=True):
                drafter.graphs.capture(cap)
        return out

    def release(self, handle: KVHandle | ReplicaHandle) -> None:
        """Free a handle's KV pages; KVHandleError (a BatchError) for a handle that is
        not live here (released already, or from another engine). Under attention DP
        (a ReplicaHandle) the replica that holds it frees it."""
        if isinstance(handle, ReplicaHandle):
            if handle.local is not None:
                self.parts.kv.release(handle.local)
            return
        self.parts.kv.release(handle)
        if self.parts.drafter is not None:
            self.parts.drafter.forget(handle.seq_id)

    def kv_meta(self, handle: KVHandle):
        """The export metadata of one request's KV, in its family's export format
        (graphcp.pd.export; a DSA model's: graphcp.model.dsa.export; a DeepSeek V4 model's:
        graphcp.model.dsv4.export)."""
        return self._exporter.meta(handle)

    @torch.inference_mode()
    def export_kv(self, handle: KVHandle, dst: int | None = None):
        """One request's KV in the transport-neutral layout of its family's export format
        (graphcp.pd.export: every layer's K and V, ``[num_kv_heads, num_tokens,
        head_dim]``, keys after RoPE; a DSA model: latent, rope key and indexer key,
        graphcp.model.dsa.export; a DeepSeek V4 model: transformers' cache state,
        graphcp.model.dsv4.export). Every rank of the run calls it (like prefill); ``dst`` is
        the rank that gets the export (the others get None), None: every rank. ``dst`` is
        a rank of the whole run (``engine.world``: every stage, CP and attention-TP rank,
        numbered as ``torch.distributed`` numbers them, graphcp.mesh); one outside it is
        an InputError. Each rank contributes the spans its cache mode holds; only this
        request's KV moves. Releases nothing (``release`` stays explicit); KVHandleError
        for a handle that is not live here.

        Under attention TP each head shard is assembled over its CP group, then the heads
        are gathered over attention TP (graphcp.pd.heads); under pipeline stages each
        stage assembles its own layers, then each stage's layers travel to the receivers
        in one message (graphcp.pd.export.gather_stages); under attention DP (a ReplicaHandle)
        the replica that holds the request assembles it, then sends it to ``dst`` or
        broadcasts it in one message (graphcp.pd.export.send_export)."""
        return self._exporter.export(handle, dst)

    def export_kv_batch(self, handles: Sequence[KVHandle], dst: int | None = None) -> list:
        """:meth:`export_kv` for each handle, in order (all handles checked first)."""
        for h in handles:
            self._exporter.check_handle(h)
        return [self.export_kv(h, dst) for h in handles]

    @torch.inference_mode()
    def import_kv(self, exported) -> KVHandle | ReplicaHandle:
        """One request's KV exported by any graphcp engine of this model (any CP size,
        cache mode, attention TP, pipeline split or attention DP: what ``export_kv``,
        ``graphcp.read_kv`` or a ``KVReceiver`` gives; or a file's path), placed in this
        engine's cache as if this engine had prefilled the request: each rank stores what
        its cache mode assigns it (the token-sharded cache's zigzag share with the ledger
        to match, a layer-split rank its layers, every rank under the replicated cache),
        its heads under attention TP, its stage's layers under pipeline stages. Every rank
        of the engine calls it with the same payload (SPMD) and gets the handle (under
        attention DP a ReplicaHandle: the replica with the most free pages holds it), which
        ``decode``, ``generate`` and a next turn's ``prefill(prefix=...)`` accept. The
        payload's ``last_logits`` give the first decode step's token: no recompute.
        Refused with nothing changed: another model, format or dtype (KVImportError, one
        line), a full pool (KVCacheFull). docs/pd.md, "Import"."""
        return self._importer.import_kv(exported)

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
            call = self._call(batch, all_logits, force_eager, microbatches, aux_hidden_layers, draft_next)
            out = self._driver(call).run(batch, call)
            out.info.timings["total_s"] = time.perf_counter() - t0
            return out

    @torch.inference_mode()
    def decode(self, handles: Sequence[KVHandle], tokens, force_eager: bool = False, logits: bool = False,
               stop: Sequence[int] | None = None) -> DecodeOutput:
        """One decode step (docs/decode.md): ``tokens[j]`` (one token id a request) after
        the KV of ``handles[j]`` (live handles of this engine, each once), on every rank
        with the same arguments (SPMD, like ``prefill``). Returns each request's greedy next
        token (``tokens``, chosen on the device, the same on every rank) and its handles,
        one token longer; with ``logits=True`` also the next-token logits (float32 ``[B,
        vocab]``, copied to the host only then); with ``stop`` (token ids) whether each next
        token is one (``stopped``, tested on the device). Each rank attends over the KV its
        cache mode holds and the partial outputs are merged exactly; the new token's K/V is
        stored where the mode puts it (the token-sharded cache: on one rank, evenly over a
        request's ranks). With graphs, the step replays its batch-size bucket's decode graph
        (``force_eager`` skips it). BatchError (nothing changed) for an empty batch, a handle
        that is not live here, a token outside the vocabulary, a request at the model's
        context. ``tokens [requests, n]``: n tokens a request in one step, causal among them
        (every one kept; outputs ``[requests, n]``: docs/speculative.md)."""
        stops = None if stop is None else stop_tokens(stop, self.cfg.vocab_size, "decode: stop")
        return self._decode(handles, tokens, force_eager, logits, stops)

    @torch.inference_mode()
    def generate(self, requests, max_new_tokens: int, stop: Sequence[int] | None = None, logits: bool = False,
                 release: bool = True, progress: bool = False, draft_tokens: int | None = None) -> GenerateOutput:
        """Greedy generation (docs/decode.md): each request (token ids, a ``Request``, or a
        ``Conversation`` of turns) prefilled, then up to ``max_new_tokens`` tokens a turn,
        one decode step each, until a token of ``stop``; a conversation's next turn is
        prefilled after the tokens generated. Every turn of every request runs in one batch.
        ``logits``: also return each step's logits; ``release=False`` keeps the KV (the
        output's handles: export or extend them); ``progress``: a bar over the steps.
        ``draft_tokens``: speculative decoding with the engine's EAGLE-3 draft
        (``RuntimeConfig.draft``), k proposals verified a step (docs/speculative.md,
        "Decoding"): the same tokens in fewer steps; ``GenerateOutput.speculative`` says how many."""
        return generate(self, requests, max_new_tokens, stop, logits, release, progress, draft_tokens)

    def capture_decode(self, pages: int | None = None, progress: bool = False) -> list[int]:
        """Capture every decode batch-size bucket's graph for steps whose requests hold at
        most ``pages`` pages on a rank (None: any; graph modes); the batch sizes captured."""
        return self.parts.decoder.capture(pages, progress)

    def _driver(self, call: PrefillCall) -> ForwardDriver:
        """Attention-DP replicas, one forward (a draft runs one), or micro-batches (any
        call under pipeline stages)."""
        if self._dp is not None:
            return self._dp
        if self.parts.drafter is not None or (self.parts.pipeline is None and call.microbatches == 1):
            return self._single
        return self._microbatched

    def _call(self, batch, all_logits: bool, force_eager: bool, microbatches: int | None,
              aux_layers: Sequence[int] | None, draft_next) -> PrefillCall:
        """The call's options, checked (nothing has changed when this raises)."""
        m = self._microbatches(microbatches)
        aux = self._aux_layers(aux_layers)
        fingerprint = (int(bool(all_logits)), int(bool(force_eager)), m, len(aux), *aux)
        nxt = draft_next_tokens(self.parts.drafter, batch, draft_next, m, self.parts.cfg.vocab_size,
                                self.parts.kv.cache_id)
        if nxt is not None:
            fingerprint += (len(nxt), *nxt.tolist())
        return PrefillCall(bool(all_logits), bool(force_eager), m, aux, fingerprint, nxt)

    def _microbatches(self, m: int | None) -> int:
        if m is None:
            return self.runtime.microbatches
        return check_int(m, "microbatches", lo=1, hi=MAX_MICROBATCHES, where="prefill", err=InputError)

    def _aux_layers(self, layers: Sequence[int] | None) -> tuple[int, ...]:
        """The layers a call asks for, checked (nothing has changed when this raises)."""
        rt = self.runtime
        if layers is None:
            return rt.aux_hidden_layers
        layers = check_layer_list(layers, "prefill: aux_hidden_layers", self.parts.cfg.num_layers, err=BatchError)
        missing = [i for i in layers if i not in rt.aux_hidden_layers]
        if self.parts.runner is not None and missing:
            raise BatchError(
                f"prefill: aux_hidden_layers asks for layer {missing[0]}, which the graphs do not copy "
                f"(RuntimeConfig.aux_hidden_layers={list(rt.aux_hidden_layers)}, graph={rt.graph!r}): "
                "a captured graph copies the layers fixed when the engine is built; add it there"
            )
        return layers

    # ---- stats ------------------------------------------------------------------
    def stats(self) -> dict:
        """What this rank did (the shape is documented in :mod:`graphcp.runtime.stats`; the
        stats file lists every rank's)."""
        p, kv = self.parts, self.parts.kv
        return {
            "rank": self.rank, "cp_size": p.group.size, "world_rank": self.world_rank,
            # the mesh: this rank's (dp, cp, attn_tp) coordinates, the degrees, the KV heads it stores
            "mesh": p.mesh.coords.as_dict(), "tp_size": p.parallel.tp_size,
            "attn_tp_size": p.parallel.attn_tp_size, "dp_size": p.parallel.dp_size,
            "kv_heads": p.attn_cfg.num_kv_heads,
            "stage": 0 if p.pipeline is None else p.pipeline.stage,
            "layers": [p.model.stage.layers.start, p.model.stage.layers.stop], "kv_cache": self.runtime.kv_cache,
            "exchange": p.exchange.setting(),
            "kv_pool_tokens": (kv.num_pages - 1) * kv.page_size,
            "kv_pool_bytes": kv.pool_bytes,  # every page pool (MLA: latent and indexer keys) and state pool
            # each pool's bytes (V4: window, source rows and entries of each layer kind)
            "kv_pools": {name: t.numel() * t.element_size() for name, t in kv.page_pools().items()},
            # each per-request state pool's bytes (a hybrid's linear layers: recurrent and conv states)
            "kv_state_pools": {name: t.numel() * t.element_size() for name, t in kv.state_pools().items()},
            "kv_stored_tokens": kv.stored_tokens(),
            "kv_stored_pages": kv.stored_pages(),
            "forwards": list(p.recorder.forwards),
            "forwards_dropped": p.recorder.dropped,
            "decode_steps": list(p.recorder.decode_steps),
            "decode_steps_dropped": p.recorder.decode_dropped,
        }

    def reset_stats(self) -> None:
        """Forget the forwards recorded so far."""
        self.parts.recorder.reset()


def prefill_prefixes(engine: PrefillEngine, prefixes: Sequence[object | None],
                     next_tokens: Sequence[int] | None = None) -> list[KVHandle | None]:
    """Prefill the given prefixes (token ids; None for a request without one) in one
    forward: the handles a batch of chunked requests then extends. ``next_tokens``: the
    token that follows each prefix (its draft's last row takes it: an engine with a draft)."""
    idx = [i for i, p in enumerate(prefixes) if p is not None]
    handles: list[KVHandle | None] = [None] * len(prefixes)
    if idx:
        kw = {} if engine.parts.drafter is None else {"draft_next": None if next_tokens is None else
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
