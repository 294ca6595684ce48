"""A decode step end to end (``PrefillEngine.decode``), the decode phase's driver: the
step checked, reserved and planned by the decode planner (``plan``), run through the one
forward (graphcp.runtime.forward.StageForward: its bucket's decode graph, or eager), the
logits from the LM head (every rank holds every row: no gather), the handles one token
longer, the step recorded; on any failure the reservation is given back.

What reaches the host is small: the next tokens are chosen on the device (greedy argmax,
and the stop-token test when stop tokens are given) and copied through pinned memory
(graphcp.attention.staging.PinnedDownload); the host waits for them by polling, under the
collective timeout (graphcp.runtime.capture.watchdog: a replay whose peer died ends in a
CollectiveError instead of a hang). The ``[B, vocab]`` logits are copied only when asked
(``logits=True``)."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from graphcp.attention.phase import DECODE
from graphcp.attention.staging import PinnedDownload, to_device
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings, runtime_settings
from graphcp.config import ParallelConfig, RuntimeConfig
from graphcp.dist import CPGroup
from graphcp.errors import ConfigError
from graphcp.kv.handle import KVHandle
from graphcp.kv.paged import PagedKVCache
from graphcp.model.llama import DecoderModel
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import DecodeOutput, PreparedBatch
from graphcp.runtime.body import Body
from graphcp.runtime.capture.phases import DecodeGraphs
from graphcp.runtime.capture.runner import GraphRunner
from graphcp.runtime.capture.watchdog import stream_done, wait_for
from graphcp.runtime.decode.plan import DecodePlanner
from graphcp.runtime.draft import DraftRunner
from graphcp.runtime.forward import StageForward
from graphcp.runtime.stats import Recorder


class Decoder:
    """The engine's decode steps (see the module doc): one of the engine's parts
    (``engine.parts.decoder``, wired by graphcp.runtime.build)."""

    def __init__(self, model: DecoderModel, kv: PagedKVCache, body: Body, runner: GraphRunner | None,
                 group: CPGroup, runtime: RuntimeConfig, parallel: ParallelConfig, kind: str,
                 stage: StageForward, recorder: Recorder, drafter: DraftRunner | None = None) -> None:
        """``group``: the ranks that must be given the same step (the stage's: attention TP
        ranks too); ``kind``: the model's value of the combinations' model axis
        (ModelFamily.kind); ``stage``: the one forward; ``recorder``: the engine's stats;
        ``drafter``: an EAGLE-3 draft's phase (a plain step does not run it: the draft's
        K/V of the tokens it adds stay unwritten, and the draft no longer holds a next
        token for them; speculative decoding runs it: graphcp.runtime.decode.speculative)."""
        self.model, self.kv, self.body, self.runner, self.group = model, kv, body, runner, group
        self.runtime, self.parallel, self.kind = runtime, parallel, kind
        self.stage, self.recorder, self.drafter = stage, recorder, drafter
        self._preparer: DecodePlanner | None = None
        self._combines = False
        self._download = PinnedDownload()
        self._stops: tuple[frozenset, torch.Tensor] | None = None  # the stop tokens last given, on the device

    @property
    def preparer(self) -> DecodePlanner:
        """A decode step's checks, reservation and plan, made on first use (an engine that
        never decodes, or whose options decode refuses, builds none)."""
        if self._preparer is None:
            self.check_combination()
            cfg = self.model.cfg
            self._preparer = DecodePlanner(self.kv, self.group, cfg.vocab_size, cfg.max_position_embeddings,
                                           self.body.device, self.body.plan_decode, self.runtime.check_consistency,
                                           self.most_rows)
        return self._preparer

    @property
    def most_rows(self) -> int:
        """The most rows a request may give one step (a verify step's pending token and
        draft tokens): the largest decode bucket, so one request's step fits a graph."""
        return max(self.runtime.decode_buckets)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode phase's graphs (None: RuntimeConfig.graph='off'), made on first use."""
        if self.runner is None:
            return None
        self.check_combination()
        return self.runner.phase(DECODE)

    def capture(self, pages: int | None = None, progress: bool = False) -> list[int]:
        """Capture every batch-size bucket's decode graph for the page bucket that holds
        ``pages`` (None: the widest), largest first; the batch sizes captured."""
        graphs = self.graphs
        if graphs is None:
            raise ConfigError("RuntimeConfig.graph='off': there is no decode graph to capture")
        stats = self.runner.capture_keys(DECODE, graphs.capture_order(pages), progress, "capturing decode buckets")
        return [s.capacity for s in stats]

    def check_combination(self, call: str = "PrefillEngine.decode") -> None:
        """ConfigError when this engine's options do not combine with decode
        (graphcp/combinations.py), naming ``call``: what the caller called."""
        if self._combines:
            return
        rt = self.runtime
        check_combination({**runtime_settings(rt), **parallel_settings(self.parallel), "model": self.kind,
                           "moe": rt.moe, "decode": "on"}, family=self.model.cfg.family, names={"decode": call})
        self._combines = True  # (the options are fixed: checked once)

    def decode(self, handles: Sequence[KVHandle], tokens: Any, force_eager: bool = False, logits: bool = False,
               stop: frozenset[int] | None = None) -> DecodeOutput:
        """``stop``: token ids (checked by the caller) whose test runs on the device.
        ``tokens``: one a request, or ``[requests, n]``: n tokens a request in one step (its
        rows causal among them), every one kept; the outputs are ``[requests, n]`` then
        (logits ``[requests, n, vocab]``)."""
        self.check_combination()
        t0 = time.perf_counter()
        prep = self.preparer.prepare(handles, tokens, (int(bool(force_eager)),))
        rows, res = self.run(prep, force_eager)
        try:
            with nvtx_range("next_tokens", category="output"):
                nxt = self._next_tokens(rows, stop, res.info)
            kept = rows.cpu() if logits else None  # the [B, vocab] copy, asked for (the step has run: no wait)
        except BaseException:
            self.preparer.abort(prep)
            raise
        res.info.stats["time_s"] = time.perf_counter() - t0
        self.recorder.record(prep, res.info)
        n = prep.decode.rows_per_request
        if self.drafter is not None:  # (the draft's K/V of these tokens: unwritten)
            for s in prep.seq_ids[::n]:
                self.drafter.forget(s)
        ids, hit = nxt[0].copy(), None if stop is None else nxt[1].astype(bool)
        if n > 1 or np.ndim(tokens) == 2:
            ids, hit = ids.reshape(-1, n), None if hit is None else hit.reshape(-1, n)
            kept = None if kept is None else kept.view(-1, n, kept.shape[-1])
        return DecodeOutput(ids, [self.kv.handle(s) for s in prep.seq_ids[::n]], res.info, kept, hit)

    def run(self, prep: PreparedBatch, force_eager: bool, aux: tuple[int, ...] = ()) -> tuple[torch.Tensor, Any]:
        """A prepared step through the one forward: every row's logits (float32 [rows,
        vocab], on the device) and the StageResult (its auxiliary rows of ``aux``); on any
        failure its reservation is given back."""
        try:
            res = self.stage.run(prep, None, force_eager, aux)
            with nvtx_range("lm_head", category="output"):
                return self.model.logits(res.hidden[: prep.rows]), res
        except BaseException:
            self.preparer.abort(prep)
            raise

    def _next_tokens(self, rows: torch.Tensor, stop: frozenset[int] | None, info) -> np.ndarray:
        """int64 [1 or 2, B] on the host: the greedy next tokens (and with ``stop``, whether
        each is a stop token), chosen on the device and copied through pinned memory once
        the step ran, waited for under the collective timeout."""
        ids = rows.argmax(-1)
        dev = ids[None] if stop is None else torch.stack([ids, torch.isin(ids, self._stop_tensor(stop)).long()])
        host = self._download.start(dev)
        done = stream_done(rows.device)  # after the copy: the step's replay (or eager work) and the download
        where = f"decode step ({info.path}{'' if info.path != 'graph' else f', bucket {info.bucket}'})"
        wait_for(done, self.group, where)
        return host.numpy()

    def _stop_tensor(self, stop: frozenset[int]) -> torch.Tensor:
        """The stop tokens on the device (uploaded once for a generate call's steps)."""
        if self._stops is None or self._stops[0] != stop:
            ids = np.array(sorted(stop), dtype=np.int64)
            self._stops = (stop, to_device(ids, self.body.device))
        return self._stops[1]
