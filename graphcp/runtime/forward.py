"""The one forward, and the drivers: how one ``prefill`` call runs its batch.

:class:`StageForward` runs a prepared batch of either phase through this rank's stage:
the bucket's graph, or eager (a decode step's driver is graphcp.runtime.decode.decoder).
Three drivers implement :class:`ForwardDriver` over the same parts (:class:`ForwardParts`):
one forward (:class:`SingleForward`), micro-batches through a pipeline stage
(``graphcp/runtime/pp/prefill.py``) and attention-DP replicas (``graphcp/runtime/dp.py``).
Each prepares, runs this rank's rows through :class:`StageForward`, makes outputs with
the :class:`~graphcp.runtime.outputs.OutputHead`, records the forward and assembles one
PrefillOutput (graphcp.runtime.outputs.assemble); a failure gives every reservation back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from graphcp.attention.staging import to_device
from graphcp.kv.paged import PagedKVCache
from graphcp.model.forward_context import AuxCapture
from graphcp.runtime.batch import BatchPreparer, ForwardInfo, PrefillOutput, PreparedBatch, Request
from graphcp.runtime.body import Body
from graphcp.runtime.capture.runner import Fallback, GraphRunner
from graphcp.runtime.draft import DraftRunner
from graphcp.runtime.outputs import OutputHead, assemble
from graphcp.runtime.stats import Recorder


@dataclass(frozen=True)
class PrefillCall:
    """One prefill call's options, checked (graphcp.runtime.engine.PrefillEngine.prefill)."""

    all_logits: bool
    force_eager: bool
    microbatches: int
    #: the auxiliary layers asked for, in order (the stages copy these out)
    aux: tuple[int, ...]
    #: the call's options as integers: every rank must agree on them (the batch's fingerprint)
    fingerprint: tuple[int, ...]
    #: an engine with a draft: per request the token after its new tokens (-1: greedy)
    draft_next: np.ndarray | None = None


@dataclass
class StageResult:
    """This rank's body rows of one forward, its info, and the rows of the asked auxiliary
    layers this stage holds ([rows, n, hidden] in the asked order; None when it holds none)."""

    hidden: torch.Tensor
    info: ForwardInfo
    aux_rows: torch.Tensor | None


@dataclass
class StageForward:
    """One prepared batch of either phase through this rank's stage: replayed from its
    bucket's graph, or eager when the graphs do not take it (the Fallback says why)."""

    body: Body
    runner: GraphRunner | None

    def run(self, prep: PreparedBatch, hidden_in: torch.Tensor | None, force_eager: bool, aux: tuple[int, ...],
            rows: int | None = None, agreed_fallback: str | None = None) -> StageResult:
        """``rows``: the rows the forward must hold (attention DP: the largest replica's;
        default this batch's); ``agreed_fallback``: why every rank runs eagerly, agreed
        between them (attention DP), or None."""
        model = self.body.model
        mine = tuple(i for i in aux if i in model.stage.layers) if aux else ()
        fallback = None
        if self.runner is not None and not force_eager:
            outcome = self.runner.try_replay(prep, hidden_in, rows, agreed_fallback)
            if not isinstance(outcome, Fallback):
                hidden, info = outcome
                info.stats.update(prep.stats)
                return StageResult(hidden, info, self._replayed_aux(prep, mine, info.capacity))
            fallback = outcome.reason
        required = rows or prep.rows
        capture = None
        if mine:
            out = torch.empty(required, len(mine), model.cfg.hidden_size, dtype=model.dtype, device=self.body.device)
            capture = AuxCapture(mine, out)
        hidden = self.body.eager(prep, required, hidden_in, capture)
        info = ForwardInfo("eager", required, required, fallback, phase=prep.phase)
        info.stats.update(prep.stats)
        return StageResult(hidden, info, None if capture is None else capture.out)

    def _replayed_aux(self, prep: PreparedBatch, mine: tuple[int, ...], capacity: int) -> torch.Tensor | None:
        """The replayed bucket's auxiliary rows of ``mine`` (its phase's: a decode step's
        graphs copy the prefill graphs' layers too)."""
        if not mine:
            return None
        ph = self.runner.phases[prep.phase]
        cols = to_device(np.array([ph.aux_layers.index(i) for i in mine], dtype=np.int64), self.body.device)
        # a copy: the static rows are overwritten by the next replay
        return ph.aux_rows(capacity).index_select(1, cols)


@dataclass
class ForwardParts:
    """What every driver runs a batch with."""

    preparer: BatchPreparer
    kv: PagedKVCache
    stage: StageForward
    head: OutputHead
    recorder: Recorder


class ForwardDriver(Protocol):
    def run(self, batch: Sequence[Request], call: PrefillCall) -> PrefillOutput: ...


@dataclass
class SingleForward:
    """The whole batch in one forward on this rank's CP group (and an EAGLE-3 draft's
    phase after it)."""

    parts: ForwardParts
    drafter: DraftRunner | None = None

    def run(self, batch: Sequence[Request], call: PrefillCall) -> PrefillOutput:
        p = self.parts
        prep = p.preparer.prepare(batch, call_args=call.fingerprint)
        try:
            # the draft's input layers ride with the asked ones (graphs copy both)
            layers = call.aux if self.drafter is None else self.drafter.with_input_layers(call.aux)
            res = p.stage.run(prep, None, call.force_eager, layers)
            res.info.timings["plan_s"] = prep.plan_s
            res.info.stats.update(p.stage.body.attention.forward_stats(prep.plan.prefix_lens, prep.plan.extend_lens))
            asked = res.aux_rows[:, :len(call.aux)] if call.aux else None
            out = p.head.outputs(prep.plan, res.hidden, asked, call.all_logits)
            draft = None if self.drafter is None else self.drafter.after_target(
                prep, batch, layers, res, out.last, call.draft_next, call.all_logits)
        except BaseException:
            p.preparer.abort(prep)
            raise
        p.recorder.record(prep, res.info)
        if draft is not None:
            self.drafter.remember(prep.seq_ids, draft)
        R = len(prep.seq_ids)
        return assemble(R, [(range(R), out)], [p.kv.handle(s) for s in prep.seq_ids], res.info, draft)
