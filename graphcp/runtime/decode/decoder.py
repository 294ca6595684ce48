"""A decode step end to end (``PrefillEngine.decode``): checked, reserved and planned
(``batch``), run on its bucket's decode graph or eagerly (``graphs``, ``step``), the
logits from the LM head (every rank holds every row: no gather), the handles one token
longer, the step recorded; on any failure the reservation is given back."""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings, runtime_settings
from graphcp.kv.paged import KVHandle
from graphcp.model.communicator import ReplicatedRows
from graphcp.model.forward_context import KV_RECEIVED
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.build import EngineParts
from graphcp.runtime.decode.batch import DecodeOutput, PreparedStep, StepInfo, StepPreparer
from graphcp.runtime.decode.graphs import DecodeGraphs, Fallback
from graphcp.runtime.decode.step import StepBody
from graphcp.runtime.stats import Recorder


class Decoder:
    """The engine's decode steps (see the module doc)."""

    def __init__(self, parts: EngineParts, recorder: Recorder) -> None:
        self.parts, self.recorder = parts, recorder
        self._body: StepBody | None = None
        self._preparer: StepPreparer | None = None
        self._graphs: DecodeGraphs | None = None
        self._combines = False

    @property
    def body(self) -> StepBody:
        """The decode step's body, made on first use (an engine that never decodes, or whose
        options decode refuses, builds none: its exchange may have no decode step)."""
        if self._body is None:
            self.check_combination()
            p, m = self.parts, self.parts.mesh
            self._body = StepBody(p.model, p.kv, p.group, p.device, p.body.attention,
                                  p.exchange, ReplicatedRows(m.cp, m.attn_tp, m.ffn, m.dp), p.runtime.decode_merge)
        return self._body

    @property
    def preparer(self) -> StepPreparer:
        """A decode step's checks, reservation and plan (made with the body)."""
        if self._preparer is None:
            p = self.parts
            self._preparer = StepPreparer(p.kv, p.mesh.ffn, p.cfg.vocab_size, p.cfg.max_position_embeddings,
                                          p.device, self.body.plan, p.runtime.check_consistency)
        return self._preparer

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode graphs (None: RuntimeConfig.graph='off'), made on first use (an engine
        that never decodes, or whose model decode refuses, builds none)."""
        rt = self.parts.runtime
        if self._graphs is None and rt.graph != "off":
            self.check_combination()
            self._graphs = DecodeGraphs(self.body, rt.decode_buckets, rt.graph_backend, rt.verify_capture)
        return self._graphs

    def check_combination(self, call: str = "PrefillEngine.decode") -> None:
        """ConfigError when this engine's options do not combine with decode
        (graphcp/combinations.py), naming ``call``: what the caller called."""
        if self._combines:
            return
        p, rt = self.parts, self.parts.runtime
        check_combination({**runtime_settings(rt), **parallel_settings(p.parallel), "model": p.family.kind(p.cfg),
                           "moe": rt.moe, "decode": "on"}, family=p.cfg.family, names={"decode": call})
        self._combines = True  # (the options are fixed: checked once)

    def decode(self, handles: Sequence[KVHandle], tokens: Any, force_eager: bool = False) -> DecodeOutput:
        self.check_combination()
        t0 = time.perf_counter()
        step = self.preparer.prepare(handles, tokens, (int(bool(force_eager)),))
        try:
            hidden, info = self._run(step, force_eager)
            with nvtx_range("lm_head", category="output"):
                logits = self.parts.model.logits(hidden).cpu()
        except BaseException:
            self.preparer.abort(step)
            raise
        info.stats["time_s"] = time.perf_counter() - t0
        self.recorder.record_decode(info)
        return DecodeOutput(logits, [self.parts.kv.handle(s) for s in step.slots.seq_ids], info)

    def _run(self, step: PreparedStep, force_eager: bool) -> tuple[torch.Tensor, StepInfo]:
        """The step's final hidden rows [B, hidden] on its bucket's graph, or eagerly."""
        stats: dict[str, Any] = {}
        fallback = None
        if self.graphs is not None and not force_eager:
            outcome = self.graphs.try_replay(step, stats)
            if not isinstance(outcome, Fallback):
                hidden, bucket, launches = outcome
                return hidden, self._info(step, StepInfo("graph", bucket), stats, launches)
            fallback = outcome.reason
        hidden = self.body.eager(step, stats)
        return hidden, self._info(step, StepInfo("eager", None, fallback), stats, None)

    def _info(self, step: PreparedStep, info: StepInfo, stats: dict, launches: int | None) -> StepInfo:
        """The step's figures: its rows and cached tokens, the merge and the bytes it received."""
        merged = int(stats.pop(KV_RECEIVED, 0))
        layers = len(self.parts.model.stage.layers)
        info.stats.update(rows=step.num_requests, cached_tokens=int(step.slots.positions.sum()),
                          decode_merge=stats.pop("decode_merge", step.merge), bytes_merged=merged,
                          bytes_merged_per_layer=merged // layers, launches=launches, **stats)
        return info
