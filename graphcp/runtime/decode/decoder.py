"""A decode step end to end (``PrefillEngine.decode``), the decode phase's driver (under
attention DP each replica's step: graphcp.runtime.decode.dp): the
step checked, reserved and planned by the decode planner (``plan``), run through the one
forward (graphcp.runtime.forward.StageForward: its bucket's decode graph, or eager), the
logits from the LM head (every rank holds every row: no gather), the handles one token
longer, the step recorded; on any failure the reservation is given back.

Under pipeline stages the step's rows go through the stages as a prefill's micro-batch
does (graphcp.runtime.pp.schedule.run_stage over the same links: rank (s, r) hands its
rows, the same on every rank of a stage, to (s + 1, r)); every stage reserves the step in
its own cache (their allocators stay in step), and the last stage's logits are broadcast
to every rank of the pipeline, as a prefill's are. A step is one micro-batch: its rows
are a few per request, and splitting them would add a forward's fixed cost per piece."""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from graphcp.attention.phase import DECODE
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings, runtime_settings
from graphcp.config import ParallelConfig, RuntimeConfig
from graphcp.dist import CPGroup
from graphcp.errors import ConfigError
from graphcp.kv.handle import KVHandle
from graphcp.kv.paged import PagedKVCache
from graphcp.mesh import MeshGroups
from graphcp.model.llama import DecoderModel
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import DecodeOutput, ForwardInfo, PreparedBatch
from graphcp.runtime.body import Body
from graphcp.runtime.capture.phases import DecodeGraphs
from graphcp.runtime.capture.runner import GraphRunner
from graphcp.runtime.decode.dp import DataParallelDecode
from graphcp.runtime.decode.plan import DecodePlanner
from graphcp.runtime.forward import StageForward
from graphcp.runtime.pp.groups import PipelineGroups
from graphcp.runtime.pp.schedule import run_stage
from graphcp.runtime.stats import Recorder


class Decoder:
    """The engine's decode steps (see the module doc): one of the engine's parts
    (``engine.parts.decoder``, wired by graphcp.runtime.build)."""

    def __init__(self, model: DecoderModel, kv: PagedKVCache, body: Body, runner: GraphRunner | None,
                 group: CPGroup, runtime: RuntimeConfig, parallel: ParallelConfig, kind: str,
                 stage: StageForward, recorder: Recorder, pipeline: PipelineGroups | None = None,
                 mesh: MeshGroups | None = None) -> None:
        """``group``: the ranks that must be given the same step (the stage's: attention TP
        ranks too; every stage's under pipeline stages); ``kind``: the model's value of the
        combinations' model axis (ModelFamily.kind); ``stage``: the one forward;
        ``recorder``: the engine's stats; ``pipeline``: the stages' groups and links (None:
        one stage); ``mesh``: the stage's groups (attention DP's replicas)."""
        self.model, self.kv, self.body, self.runner, self.group = model, kv, body, runner, group
        self.runtime, self.parallel, self.kind = runtime, parallel, kind
        self.stage, self.recorder, self.pipeline, self.mesh = stage, recorder, pipeline, mesh
        self._preparer: DecodePlanner | None = None
        self._replicas: DataParallelDecode | None = None
        self._combines = False

    @property
    def preparer(self) -> DecodePlanner:
        """A decode step's checks, reservation and plan, made on first use (an engine that
        never decodes, or whose options decode refuses, builds none)."""
        if self._preparer is None:
            self.check_combination()
            cfg = self.model.cfg
            self._preparer = DecodePlanner(self.kv, self.group, cfg.vocab_size, cfg.max_position_embeddings,
                                           self.body.device, self.body.plan_decode, self.runtime.check_consistency)
        return self._preparer

    @property
    def replicas(self) -> DataParallelDecode | None:
        """Attention DP's decode steps (None without DP), made on first use."""
        if self._replicas is None and self.parallel.dp_size > 1:
            m = self.mesh
            self._replicas = DataParallelDecode(m.coords.dp, self.parallel.dp_size, m.dp, m.ffn, self.body.device,
                                                self.model.cfg.vocab_size, self.preparer, self.forward, self.recorder)
        return self._replicas

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

    def decode(self, handles: Sequence[KVHandle], tokens: Any, force_eager: bool = False) -> DecodeOutput:
        self.check_combination()
        if self.parallel.dp_size > 1:  # each replica its own requests (under DP: ReplicaHandles)
            return self.replicas.decode(handles, tokens, force_eager)
        t0 = time.perf_counter()
        prep = self.preparer.prepare(handles, tokens, (int(bool(force_eager)),))
        try:
            logits, info = self.forward(prep, force_eager)
        except BaseException:
            self.preparer.abort(prep)
            raise
        info.stats["time_s"] = time.perf_counter() - t0
        self.recorder.record(prep, info)
        return DecodeOutput(logits, [self.kv.handle(s) for s in prep.seq_ids], info)

    def forward(self, prep: PreparedBatch, force_eager: bool, rows: int | None = None,
                fallback: str | None = None) -> tuple[torch.Tensor, ForwardInfo]:
        """A prepared step through this rank's stage (and the stages before and after it):
        float32 [B, vocab] logits of its B requests on the host, the same on every rank of
        the pipeline, and the forward's info. ``rows``, ``fallback``: the rows every rank's
        forward holds and why they all run eagerly, as the ranks agreed (attention DP)."""
        pp, B = self.pipeline, len(prep.seq_ids)
        if pp is None:
            res = self.stage.run(prep, None, force_eager, (), rows, fallback)
            return self._logits(res.hidden, B), res.info
        got: list = []

        def forward(_: int, hidden_in: torch.Tensor | None) -> torch.Tensor:
            res = self.stage.run(prep, hidden_in, force_eager, (), rows, fallback)
            # now: a replay's rows are static, which the next stage's send copies first
            got.append((res.info, self._logits(res.hidden, B) if self.model.stage.last else None))
            return res.hidden

        model = self.model
        times = run_stage([prep.ids.shape[0]], forward, lambda n: torch.empty(
            n, model.handoff_size, dtype=model.dtype, device=self.body.device), pp.prev, pp.next)
        info, logits = got[0]
        logits = pp.broadcast(logits if logits is not None else torch.empty(B, model.cfg.vocab_size),
                              pp.num_stages - 1, self.body.device)
        info.timings.update(compute_s=times.compute_s, wait_s=times.wait_s, drain_s=times.drain_s)
        info.stats["pipeline"] = {"stage": pp.stage, "stages": pp.num_stages, "sent_bytes": times.sent_bytes}
        return logits, info

    def _logits(self, hidden: torch.Tensor, rows: int) -> torch.Tensor:
        with nvtx_range("lm_head", category="output"):
            return self.model.logits(hidden[:rows]).cpu()
