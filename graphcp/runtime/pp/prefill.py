"""A prefill run as micro-batches through this rank's pipeline stage.

The engine hands over its parts (the batch preparer, the KV cache, the stage and
the pipeline's groups) and, as :class:`StageOps`, how it runs one prepared
micro-batch through the stage's body and how it turns body rows into outputs.
This module validates the batch once for every rank of the pipeline, splits it
(``microbatch.py``), prepares every micro-batch up front (all or nothing), runs
them through the stage (``schedule.py``) and assembles the outputs in batch order;
under PP they are broadcast from the stages that hold them, so every rank returns
the same :class:`PrefillOutput`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from graphcp.config import PipelineStage
from graphcp.cp import Plan
from graphcp.kv.paged import PagedKVCache
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import BatchPreparer, ForwardInfo, PrefillOutput, PreparedBatch, Request
from graphcp.runtime.pp.groups import PipelineGroups
from graphcp.runtime.pp.microbatch import Piece, last_pieces, split_microbatches
from graphcp.runtime.pp.schedule import StageTimes, run_stage

Rows = torch.Tensor


@dataclass
class StageOps:
    """How the engine runs one prepared micro-batch, and makes outputs of its rows."""

    #: (prep, input rows or None) -> (body rows, info, auxiliary rows [rows, n, hidden] or None)
    forward: Callable[[PreparedBatch, Rows | None], tuple[Rows, ForwardInfo, Rows | None]]
    last_logits: Callable[[Plan, Rows], Rows]  # float32 [requests, vocab] (the last stage)
    all_logits: Callable[[Plan, Rows], Rows]  # float32 [tokens, vocab] in batch order (the last stage)
    aux_gather: Callable[[Plan, Rows], Rows]  # float32 [tokens, n, hidden] in batch order


@dataclass
class MicrobatchedPrefill:
    preparer: BatchPreparer
    kv: PagedKVCache
    stage: PipelineStage
    pipeline: PipelineGroups | None  # None: one stage (micro-batches run one after the other)
    stage_layers: list[range]  # every stage's layers
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    #: values a row carries between stages (None: hidden_size; DeepSeek V4: its hc_mult streams)
    handoff_size: int | None = None

    def run(self, batch: Sequence[Request], ops: StageOps, m: int, call_args: Sequence[int], all_logits: bool,
            aux: tuple[int, ...]) -> PrefillOutput:
        t0 = time.perf_counter()
        flat, extend = self.preparer.validate(batch, call_args)  # once for the batch, every stage
        mbs = split_microbatches(extend.tolist(), m)
        preps = self._prepare(batch, flat, extend, mbs)
        plan_s = time.perf_counter() - t0
        try:
            out = self._run(preps, mbs, len(batch), extend, ops, all_logits, aux)
        except BaseException:
            self._abort(preps)
            raise
        out.info.timings["plan_s"] = plan_s
        return out

    def _abort(self, preps: list[PreparedBatch]) -> None:
        for prep in reversed(preps):  # last first: the allocator ends exactly as it was
            self.preparer.abort(prep)

    def _prepare(self, batch: Sequence[Request], flat: np.ndarray, extend: np.ndarray,
                 mbs: list[list[Piece]]) -> list[PreparedBatch]:
        """Reserve and plan each micro-batch (all or nothing); a request's later chunks
        extend the KV its earlier chunk reserved."""
        cu = np.concatenate([[0], np.cumsum(extend)])
        seq_of: dict[int, int] = {}
        preps: list[PreparedBatch] = []
        try:
            for pieces in mbs:
                reqs = [Request(flat[cu[p.request] + p.start: cu[p.request] + p.stop],
                                batch[p.request].prefix if p.start == 0 else self.kv.handle(seq_of[p.request]))
                        for p in pieces]
                prep = self.preparer.prepare(reqs, verified=True)
                preps.append(prep)
                seq_of.update((p.request, s) for p, s in zip(pieces, prep.seq_ids))
        except BaseException:
            self._abort(preps)
            raise
        return preps

    def _run(self, preps: list[PreparedBatch], mbs: list[list[Piece]], num_requests: int, extend: np.ndarray,
             ops: StageOps, all_logits: bool, aux: tuple[int, ...]) -> PrefillOutput:
        stage, pp = self.stage, self.pipeline
        infos: list[ForwardInfo] = []
        last: list[Rows] = []
        logits: list[Rows] = []
        aux_rows: list[Rows] = []

        def forward(k: int, hidden_in: Rows | None) -> Rows:
            prep = preps[k]
            hidden, info, rows = ops.forward(prep, hidden_in)
            infos.append(info)
            if stage.last:  # outputs now: the next micro-batch's replay overwrites the rows
                with nvtx_range("lm_head", category="output"):
                    last.append(ops.last_logits(prep.plan, hidden))
                    if all_logits:
                        logits.append(ops.all_logits(prep.plan, hidden))
            if rows is not None:
                aux_rows.append(ops.aux_gather(prep.plan, rows))
            return hidden

        times = run_stage(
            [prep.ids.shape[0] for prep in preps], forward,
            lambda n: torch.empty(n, self.handoff_size or self.hidden_size, dtype=self.dtype, device=self.device),
            pp.prev if pp else None, pp.next if pp else None,
        )
        tokens = int(extend.sum())
        with nvtx_range("pp_outputs", category="output"):
            last_logits = torch.stack([last[k][i] for k, i in last_pieces(mbs, num_requests)]) if stage.last \
                else torch.empty(num_requests, self.vocab_size)
            flat_logits = torch.cat(logits) if stage.last and all_logits else None
            if pp is not None:  # from the last stage to every rank of the pipeline
                root = pp.stage_root(pp.num_stages - 1)
                last_logits = self._broadcast(last_logits, root)
                if all_logits:
                    flat_logits = self._broadcast(
                        flat_logits if flat_logits is not None else torch.empty(tokens, self.vocab_size), root)
            aux_hidden = self._aux(aux, aux_rows, tokens) if aux else None
        ext = extend.tolist()
        return PrefillOutput(
            last_logits, [self.kv.handle(s) for s in _final_seq_ids(preps, mbs, num_requests)],
            None if flat_logits is None else list(torch.split(flat_logits, ext)), _info(infos, mbs, times, pp),
            None if aux_hidden is None else per_request(aux_hidden, ext),
        )

    def _aux(self, aux: tuple[int, ...], mine: list[Rows], tokens: int) -> Rows:
        """[T, len(aux), hidden] float32 in batch order: this stage's columns from its
        micro-batches; under PP every stage's columns, broadcast from that stage."""
        out = torch.empty(tokens, len(aux), self.hidden_size)
        pp = self.pipeline
        for s, layers in enumerate(self.stage_layers):
            held = [i for i in aux if i in layers]
            if not held:
                continue
            block = torch.cat(mine) if s == self.stage.index else torch.empty(tokens, len(held), self.hidden_size)
            if pp is not None:
                block = self._broadcast(block, pp.stage_root(s))
            out[:, [aux.index(i) for i in held]] = block
        return out

    def _broadcast(self, x: Rows, root: int) -> Rows:
        """A host tensor from global rank ``root`` to every rank of the pipeline (through
        the device: NCCL moves device memory only)."""
        return self.pipeline.world.broadcast_(x.to(self.device), root).cpu()


def per_request(rows: Rows, extend: list[int]) -> list[Rows]:
    """[T, n, hidden] in batch order -> per request [new_tokens_i, n * hidden]."""
    return [x.reshape(x.shape[0], -1) for x in torch.split(rows, extend)]


def _final_seq_ids(preps: list[PreparedBatch], mbs: list[list[Piece]], num_requests: int) -> list[int]:
    seq = [-1] * num_requests
    for prep, pieces in zip(preps, mbs):
        for p, s in zip(pieces, prep.seq_ids):
            seq[p.request] = s
    return seq


def _info(infos: list[ForwardInfo], mbs: list[list[Piece]], times: StageTimes,
          pp: PipelineGroups | None) -> ForwardInfo:
    """One ForwardInfo for a micro-batched forward: graph only when every micro-batch
    replayed; per-micro-batch paths and the stage's time split in ``stats``."""
    fallbacks = [i.fallback for i in infos if i.path == "eager"]
    info = ForwardInfo(
        "graph" if not fallbacks else "eager", max(i.capacity for i in infos), max(i.required for i in infos),
        next((f for f in fallbacks if f is not None), None),
    )
    info.timings.update(compute_s=times.compute_s, wait_s=times.wait_s, drain_s=times.drain_s)
    if len(infos) == 1:  # one forward: its figures as they are (this stage's layers under PP)
        info.stats.update(infos[0].stats)
    info.stats["pipeline"] = {
        "stage": 0 if pp is None else pp.stage, "stages": 1 if pp is None else pp.num_stages,
        # each micro-batch's own figures: they do not all add up (a ratio, a layer count)
        "microbatches": [{"tokens": sum(p.num_tokens for p in mb), "path": i.path, "capacity": i.capacity,
                          "stats": i.stats} for mb, i in zip(mbs, infos)],
        "sent_bytes": times.sent_bytes,
    }
    return info
