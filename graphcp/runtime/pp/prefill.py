"""A prefill run as micro-batches through this rank's pipeline stage: the driver
(graphcp.runtime.forward.ForwardDriver) of a call with micro-batches, or of any call
under pipeline stages.

It runs on the forward's parts (the batch preparer, the KV cache, the stage's forward,
the output head, the recorder) and the pipeline's groups. It validates the batch once
for every rank of the pipeline, splits it
(``microbatch.py``), prepares every micro-batch up front (all or nothing), runs
them through the stage (``schedule.py``) and assembles the outputs in batch order;
under PP they are broadcast from the stages that hold them, so every rank returns
the same :class:`PrefillOutput`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from graphcp.config import PipelineStage
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import ForwardInfo, PrefillOutput, PreparedBatch, Request
from graphcp.runtime.forward import ForwardParts, PrefillCall
from graphcp.runtime.outputs import RequestOutputs, assemble, per_request
from graphcp.runtime.pp.groups import PipelineGroups
from graphcp.runtime.pp.microbatch import Piece, last_pieces, split_microbatches
from graphcp.runtime.pp.schedule import StageTimes, run_stage

Rows = torch.Tensor


@dataclass
class MicrobatchedPrefill:
    parts: ForwardParts
    stage: PipelineStage
    pipeline: PipelineGroups | None  # None: one stage (micro-batches run one after the other)
    stage_layers: list[range]  # every stage's layers
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    #: values a row carries between stages (None: hidden_size; DeepSeek V4: its hc_mult streams)
    handoff_size: int | None = None

    def run(self, batch: Sequence[Request], call: PrefillCall) -> PrefillOutput:
        t0 = time.perf_counter()
        flat, extend = self.parts.preparer.validate(batch, call.fingerprint)  # once for the batch, every stage
        mbs = split_microbatches(extend.tolist(), call.microbatches)
        preps = self._prepare(batch, flat, extend, mbs)
        plan_s = time.perf_counter() - t0
        try:
            out = self._run(preps, mbs, len(batch), extend, call)
        except BaseException:
            self._abort(preps)
            raise
        out.info.timings["plan_s"] = plan_s
        return out

    def _abort(self, preps: list[PreparedBatch]) -> None:
        for prep in reversed(preps):  # last first: the allocator ends exactly as it was
            self.parts.preparer.abort(prep)

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
                                batch[p.request].prefix if p.start == 0 else self.parts.kv.handle(seq_of[p.request]))
                        for p in pieces]
                prep = self.parts.preparer.prepare(reqs, verified=True)
                preps.append(prep)
                seq_of.update((p.request, s) for p, s in zip(pieces, prep.seq_ids))
        except BaseException:
            self._abort(preps)
            raise
        return preps

    def _run(self, preps: list[PreparedBatch], mbs: list[list[Piece]], num_requests: int, extend: np.ndarray,
             call: PrefillCall) -> PrefillOutput:
        stage, pp, head, all_logits = self.stage, self.pipeline, self.parts.head, call.all_logits
        infos: list[ForwardInfo] = []
        last: list[Rows] = []
        logits: list[Rows] = []
        aux_rows: list[Rows] = []

        def forward(k: int, hidden_in: Rows | None) -> Rows:
            prep = preps[k]
            res = self.parts.stage.run(prep, hidden_in, call.force_eager, call.aux)
            self.parts.recorder.record(prep, res.info)  # each micro-batch a forward of its own
            infos.append(res.info)
            if stage.last:  # outputs now: the next micro-batch's replay overwrites the rows
                with nvtx_range("lm_head", category="output"):
                    last.append(head.last_logits(prep.plan, res.hidden))
                    if all_logits:
                        logits.append(head.all_logits(prep.plan, res.hidden))
            if res.aux_rows is not None:
                aux_rows.append(head.aux_gather(prep.plan, res.aux_rows))
            return res.hidden

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
                last_logits = pp.broadcast(last_logits, pp.num_stages - 1, self.device)
                if all_logits:
                    flat_logits = pp.broadcast(
                        flat_logits if flat_logits is not None else torch.empty(tokens, self.vocab_size),
                        pp.num_stages - 1, self.device)
            aux_hidden = self._aux(call.aux, aux_rows, tokens) if call.aux else None
        ext = extend.tolist()
        out = RequestOutputs(last_logits, None if flat_logits is None else list(torch.split(flat_logits, ext)),
                             None if aux_hidden is None else per_request(aux_hidden, ext))
        handles = [self.parts.kv.handle(s) for s in _final_seq_ids(preps, mbs, num_requests)]
        return assemble(num_requests, [(range(num_requests), out)], handles, _info(infos, mbs, times, pp))

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
                block = pp.broadcast(block, s, self.device)
            out[:, [aux.index(i) for i in held]] = block
        return out


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
