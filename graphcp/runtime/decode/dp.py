"""A decode step under attention DP (docs/parallel.md, "Attention DP"): each replica
decodes its own requests, the MLP and MoE layers over every replica's rows, as a prefill
does (graphcp.runtime.dp).

Every rank is given the whole step: the ReplicaHandles a DP prefill returned and one
token each. A replica takes the requests it holds (their local handles) and prepares its
own step; one all-gather over the stage (graphcp.runtime.dp.agree, the prefill's
agreement) then checks that every rank was given the same step, that every replica
prepared its own (a refusal on one is raised on every rank, nothing changed), and fixes
what every replica's forward shares: the rows (the largest replica's: the FFN gathers
every replica's rows, and every replica replays the same bucket) and the page bucket
(the longest share of a request on any rank). A replica with no request this step runs
padding rows only (its collectives must match), reserving nothing. The logits of every
replica's requests are gathered over DP, so every rank returns the whole step in request
order, with a ReplicaHandle a request, one token longer.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from graphcp.dist import CPGroup, gather_object
from graphcp.errors import BatchError
from graphcp.kv.handle import KVHandleError
from graphcp.runtime.batch import DecodeOutput, ForwardInfo, PreparedBatch
from graphcp.runtime.decode.plan import DecodePlanner, step_tokens
from graphcp.runtime.dp import REFUSED_ELSEWHERE, ReplicaHandle, agree, check_replica_handle
from graphcp.runtime.pp.groups import PipelineGroups
from graphcp.runtime.stats import Recorder


@dataclass
class DataParallelDecode:
    """The decode steps of one replica (see the module doc), over the decoder's planner
    and forward."""

    replica: int  # this rank's replica (its dp coordinate)
    replicas: int
    dp: CPGroup  # the replicas' ranks at this rank's (cp, attn_tp)
    stage: CPGroup  # every rank of the stage, or of the pipeline (the agreement)
    device: torch.device
    vocab_size: int
    planner: DecodePlanner
    #: the decoder's step of a prepared batch (graphcp.runtime.decode.decoder.Decoder.step):
    #: (prep, force_eager, logits, stop, rows) -> (next tokens [1 or 2, B], logits or None, info)
    step: Callable[..., tuple[np.ndarray, torch.Tensor | None, ForwardInfo]]
    recorder: Recorder
    #: the pipeline's groups (None: one stage): each stage's replica d runs the step of the
    #: same requests, the rows handed from stage to stage; the last stage's outputs of
    #: every replica are broadcast to every rank once gathered
    pipeline: PipelineGroups | None = None

    def decode(self, handles: Sequence[ReplicaHandle], tokens: Any, force_eager: bool = False, logits: bool = False,
               stop: frozenset[int] | None = None) -> DecodeOutput:
        t0 = time.perf_counter()
        handles = self._handles(handles)
        toks = step_tokens(tokens, len(handles), self.vocab_size, self.planner.most_rows)
        n = toks.shape[1]  # rows a request (a verify step's k + 1)
        mine, prep, rows = self.begin(handles, toks, force_eager)
        try:
            nxt, kept, info = self.step(prep, force_eager, logits, stop, rows, spread=self.pipeline is None)
        except BaseException:
            self.planner.abort(prep)
            raise
        info.stats["time_s"] = time.perf_counter() - t0
        if mine:
            self.recorder.record(prep, info)
        local = [self.planner.kv.handle(s) for s in prep.seq_ids[::n]]
        mine_out = (mine, nxt, kept, [h.num_tokens for h in local]) if mine else None
        parts = [p for p in gather_object(self.dp, mine_out) if p is not None]
        B = len(handles)
        out_ids = np.zeros((2, B, n), dtype=np.int64)  # the next tokens, the stop flags
        out_logits = torch.empty(B, n, self.vocab_size) if logits else None
        out: list = [None] * B
        own = dict(zip(mine, local))
        for idx, got, lg, counts in parts:
            out_ids[: got.shape[0], idx] = got.reshape(got.shape[0], len(idx), n)
            if logits:
                out_logits[idx] = lg.view(len(idx), n, -1)
            for k, j in enumerate(idx):
                out[j] = ReplicaHandle(handles[j].replica, counts[k], own.get(j))
        if self.pipeline is not None:  # from the last stage to every rank of the pipeline
            out_ids, out_logits = self._spread(out_ids, out_logits)
        info.stats["dp_assignment"] = [h.replica for h in handles]
        ids, flags, lg = out_ids[0], out_ids[1].astype(bool), out_logits
        if n == 1 and np.ndim(tokens) == 1:  # one token a request: [B] (logits [B, vocab])
            ids, flags, lg = ids[:, 0], flags[:, 0], None if lg is None else lg[:, 0]
        return DecodeOutput(ids, out, info, lg, None if stop is None else flags)

    def begin(self, handles: list[ReplicaHandle], toks: np.ndarray, force_eager: bool
              ) -> tuple[list[int], PreparedBatch, int]:
        """The step prepared on this replica (``toks``: int64 [requests, n], every rank's the
        same): the requests it holds, its prepared rows (a step of none when it holds none)
        and the rows every replica's forward holds, once every rank agreed (see the module
        doc; a refusal anywhere raised on every rank, nothing changed)."""
        mine = [j for j, h in enumerate(handles) if h.replica == self.replica]
        prep, error = None, None
        try:
            prep = self.planner.prepare([handles[j].local for j in mine], toks[mine], verified=True) if mine \
                else self.planner.idle()
        except BatchError as e:
            error = e
        rows, held = self._agree(prep, handles, toks, force_eager)
        if error is not None:
            raise error
        self.planner.pad(prep, rows, held)
        return mine, prep, rows

    def _spread(self, ids: np.ndarray, logits: torch.Tensor | None) -> tuple[np.ndarray, torch.Tensor | None]:
        pp = self.pipeline
        last = pp.num_stages - 1
        ids = pp.broadcast(torch.from_numpy(ids), last, self.device).numpy()
        return ids, None if logits is None else pp.broadcast(logits, last, self.device)

    def _handles(self, handles: Any) -> list[ReplicaHandle]:
        """The step's handles, each a ReplicaHandle of this engine's replicas carrying this
        rank's cache handle where its replica holds the request (KVHandleError otherwise)."""
        if isinstance(handles, (str, bytes)) or not isinstance(handles, SequenceABC):
            raise BatchError(f"decode: handles must be a list of ReplicaHandle, got {type(handles).__name__}")
        if len(handles) == 0:
            raise BatchError("decode: empty batch: a decode step needs at least one request")
        for j, h in enumerate(handles):
            if not isinstance(h, ReplicaHandle):
                raise KVHandleError(f"decode: request {j}: under attention DP a handle is the ReplicaHandle this "
                                    f"engine returned, got {type(h).__name__}")
            try:
                check_replica_handle(h, self.replica, self.replicas)
            except KVHandleError as e:
                raise KVHandleError(f"decode: request {j}: {e}") from None
        return list(handles)

    def _agree(self, prep: PreparedBatch | None, handles: list[ReplicaHandle], toks: np.ndarray,
               force_eager: bool) -> tuple[int, int]:
        """The replicas' agreement (graphcp.runtime.dp.agree): the whole step's fingerprint
        (tokens, replicas, lengths, the call's option), this replica's sequences; a refusal
        anywhere raised everywhere; the rows and the most held tokens every replica runs at."""
        if prep is None:
            mine = [1, 0, 0]
        else:
            kv = self.planner.kv
            held = kv.most_held(prep.decode.rows) if prep.decode.num_requests else 0
            mine = [0, len(prep.seq_ids), held]
        shape = np.array([len(handles), int(force_eager), toks.shape[1], *[h.replica for h in handles],
                          *[h.num_tokens for h in handles]], dtype=np.int64)
        local = np.asarray([] if prep is None else prep.seq_ids, dtype=np.int64)
        fingerprint = ([zlib.crc32(toks.tobytes()), zlib.crc32(shape.tobytes()), int(shape.sum()),
                        zlib.crc32(local.tobytes())] if self.planner.check_consistency else [0, 0, 0, 0])
        try:
            refused, rows, held = agree(self.stage, self.replicas, self.device, mine, fingerprint, "decode",
                                        1 if self.pipeline is None else self.pipeline.num_stages)
        except BaseException:
            if prep is not None:
                self.planner.abort(prep)
            raise
        if refused and prep is not None:
            self.planner.abort(prep)
            raise BatchError(REFUSED_ELSEWHERE)
        return max(rows, 1), held
