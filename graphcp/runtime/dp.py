"""Attention data parallelism: a batch's requests split over the D replicas of a stage.

Each replica (its C x A ranks: CP partitions, attention-TP head shards) prefills its own
requests with its own KV cache; the MLP and MoE layers still run over all T ranks of the
stage (the layer communicator gathers every replica's rows, graphcp/model/communicator.py),
so every replica runs every forward, with the same row capacity (the largest replica's).

- The assignment (:func:`assign_replicas`): requests extending a cached prefix go to the
  replica that holds it (:class:`ReplicaHandle` knows it); the others, largest causal
  attention work first, each to the least-loaded replica (ties: the lower index). Pure
  host code on the batch's lengths: the same decision on every rank.
- A replica with no request prefills one padding request of one token (SGLang pads an
  idle DP rank the same way), whose pages are given back after the forward: it joins the
  FFN collectives and never hangs them.
- Every rank of the stage must be given the same batch: its fingerprint (the whole
  batch's, before the split) rides on the one small all-gather in which the replicas
  agree on their shares, so ranks of different replicas given different batches raise a
  ``ConsistencyError`` on every rank, nothing changed, at the cost of the agreement alone.
- A refusal on one replica (a ``BatchError``) is agreed by every rank before any forward:
  every rank raises, nothing changes.
- Every rank returns the whole batch's outputs in request order, and a
  :class:`ReplicaHandle` per request.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.staging import to_device
from graphcp.dist import CPGroup, gather_object
from graphcp.errors import BatchError
from graphcp.kv.handle import KVHandle, KVHandleError
from graphcp.runtime.batch import (
    PrefillOutput,
    PreparedBatch,
    Request,
    batch_fingerprint,
    check_container,
    check_fingerprints,
    check_item_type,
    request_tokens,
)
from graphcp.runtime.capture.buckets import FALLBACK_REQUESTS
from graphcp.runtime.draft import DraftRunner, merge_drafts
from graphcp.runtime.forward import ForwardParts, PrefillCall, StageResult
from graphcp.runtime.outputs import RequestOutputs, assemble, per_request
from graphcp.runtime.pp.groups import PipelineGroups
from graphcp.runtime.pp.outputs import spread_outputs
from graphcp.runtime.pp.schedule import run_stage


@dataclass(frozen=True)
class ReplicaHandle:
    """A request's KV under attention DP: the replica that holds it, and this rank's
    cache handle when this rank is in that replica (None on the others)."""

    replica: int
    num_tokens: int
    local: KVHandle | None = None


def check_replica_handle(h: ReplicaHandle, replica: int, replicas: int) -> None:
    """KVHandleError unless ``h`` names one of the ``replicas`` and carries this rank's
    cache handle where this rank (of ``replica``) is in the replica that holds it."""
    if not 0 <= h.replica < replicas:
        raise KVHandleError(f"a ReplicaHandle of replica {h.replica}: this engine has {replicas} attention-DP "
                            "replicas")
    if (h.local is None) != (h.replica != replica):
        raise KVHandleError(f"a ReplicaHandle of replica {h.replica} passed to a rank of replica {replica} "
                            f"{'without' if h.local is None else 'with'} its local handle; pass each rank the "
                            "handles its own engine returned")


def causal_work(new: int, cached: int) -> int:
    """Query-key pairs of causal attention over ``new`` tokens after ``cached`` ones."""
    return new * (new + 1) // 2 + new * cached


def assign_replicas(new: Sequence[int], cached: Sequence[int], fixed: Sequence[int | None], replicas: int) -> list[int]:
    """Each request's replica (see the module doc); ``fixed``: a replica the request must
    go to (its prefix's), else None."""
    load = [0] * replicas
    out = [-1] * len(new)
    for i, d in enumerate(fixed):
        if d is not None:
            out[i] = d
            load[d] += causal_work(new[i], cached[i])
    free = sorted((i for i, d in enumerate(fixed) if d is None), key=lambda i: (-causal_work(new[i], cached[i]), i))
    for i in free:
        d = min(range(replicas), key=lambda r: (load[r], r))
        out[i] = d
        load[d] += causal_work(new[i], cached[i])
    return out


@dataclass
class DataParallelPrefill:
    """The attention-DP driver (graphcp.runtime.forward.ForwardDriver): this rank's
    replica's share of every batch, over the forward's parts."""

    replica: int  # this rank's replica (its dp coordinate)
    replicas: int
    dp: CPGroup  # the replicas' ranks at this rank's (cp, attn_tp)
    stage: CPGroup  # every rank of the stage, or of the pipeline (agreements)
    device: torch.device
    parts: ForwardParts
    #: the pipeline's groups and links (None: one stage); each stage's replica d hands its
    #: rows to the next stage's replica d, which holds the same requests
    pipeline: PipelineGroups | None = None
    stage_layers: list[range] | None = None  # every stage's layers (under pipeline stages)
    #: an EAGLE-3 draft's phase (None without one): each replica drafts its own requests
    #: after its target forward (the draft has no collective outside the replica)
    drafter: DraftRunner | None = None

    def run(self, batch: Sequence[Request], call: PrefillCall) -> PrefillOutput:
        if call.microbatches != 1:
            raise BatchError(f"prefill: microbatches={call.microbatches} under attention DP is not built yet (use 1)")
        reqs = self._requests(batch)
        tokens, cached, fixed = self._lengths(reqs)
        where = assign_replicas([t.size for t in tokens], cached, fixed, self.replicas)
        mine = [i for i, d in enumerate(where) if d == self.replica]
        padding = not mine
        # the token ids as the batch's rules read them (a tensor is copied to the host once)
        sub = [Request([0])] if padding else [Request(tokens[i], self._local(reqs[i].prefix)) for i in mine]
        fingerprint = self._fingerprint(tokens, cached, fixed, sub if not padding else [], call)
        prep, rows, fallback = self._prepare(sub, call, fingerprint)
        p = self.parts
        layers = call.aux if self.drafter is None else self.drafter.with_input_layers(call.aux)
        try:
            res, out = self._forward(prep, call, rows, fallback, layers)
            draft = None if self.drafter is None or padding else self.drafter.after_target(
                prep, sub, layers, res, out.last, call.draft_next[mine], call.all_logits)
        except BaseException:
            p.preparer.abort(prep)
            raise
        if padding:
            p.preparer.abort(prep)
            part, local = None, []
        else:
            p.recorder.record(prep, res.info)
            local = [p.kv.handle(s) for s in prep.seq_ids]
            if draft is not None:
                self.drafter.remember(prep.seq_ids, draft)
            part = (mine, out, [h.num_tokens for h in local], draft)
        parts = [x for x in gather_object(self.dp, part) if x is not None]
        handles: list = [None] * len(reqs)
        mine_handles = dict(zip(mine, local))
        for idx, _, counts, _ in parts:
            for k, i in enumerate(idx):
                handles[i] = ReplicaHandle(where[i], counts[k], mine_handles.get(i))
        res.info.stats["dp_assignment"] = where
        drafts = None if self.drafter is None else merge_drafts(len(reqs), [(idx, d) for idx, _, _, d in parts])
        got = assemble(len(reqs), [(idx, o) for idx, o, _, _ in parts], handles, res.info, drafts)
        if self.pipeline is None:
            return got
        model = p.stage.body.model
        return spread_outputs(self.pipeline, got, [t.size for t in tokens], call.all_logits, call.aux,
                              self.stage_layers, model.cfg.hidden_size, self.device)

    def _forward(self, prep: PreparedBatch, call: PrefillCall, rows: int, fallback: str | None,
                 layers: tuple[int, ...]) -> tuple[StageResult, RequestOutputs]:
        """This replica's share through its stage (the rows from the previous stage's same
        replica, handed on to the next's) and this stage's outputs of it; ``layers``: the
        auxiliary layers it copies out (the asked ones, then a draft's inputs)."""
        p, pp = self.parts, self.pipeline
        if pp is None:
            res = p.stage.run(prep, None, call.force_eager, layers, rows, fallback)
            return res, self._outputs(prep, res, call)
        got: list = []

        def forward(_: int, hidden_in: torch.Tensor | None) -> torch.Tensor:
            res = p.stage.run(prep, hidden_in, call.force_eager, layers, rows, fallback)
            got.append((res, self._outputs(prep, res, call)))  # now: a replay's rows are static
            return res.hidden

        model = p.stage.body.model
        times = run_stage([prep.ids.shape[0]], forward, lambda n: torch.empty(
            n, model.handoff_size, dtype=model.dtype, device=self.device), pp.prev, pp.next)
        res, out = got[0]
        res.info.timings.update(compute_s=times.compute_s, wait_s=times.wait_s, drain_s=times.drain_s)
        res.info.stats["pipeline"] = {"stage": pp.stage, "stages": pp.num_stages, "sent_bytes": times.sent_bytes}
        return res, out

    def _outputs(self, prep: PreparedBatch, res: StageResult, call: PrefillCall) -> RequestOutputs:
        """This stage's outputs of the replica's share: the logits on the last stage (a
        stage before it has no logits: placeholders the last stage's replace), the
        auxiliary hidden states of its own layers."""
        p = self.parts
        asked = None if res.aux_rows is None or not call.aux else res.aux_rows[:, :len(call.aux)]
        if self.pipeline is None or self.pipeline.next is None:
            return p.head.outputs(prep.plan, res.hidden, asked, call.all_logits)
        ext = prep.plan.extend_lens.tolist()
        aux = p.head.aux_gather(prep.plan, asked)
        return RequestOutputs(torch.empty(len(ext), p.stage.body.model.cfg.vocab_size), None,
                              None if aux is None else per_request(aux, ext))

    def _prepare(self, sub: list[Request], call: PrefillCall,
                 fingerprint: list[int]) -> tuple[PreparedBatch, int, str | None]:
        """This replica's sub-batch prepared, once every rank has agreed it was given the
        same batch and every replica has prepared its own (a different batch or a refusal
        on one is raised on every rank, nothing changed); with the rows and the
        graph-or-eager choice every replica agreed on (:meth:`_agree`)."""
        prep, error = None, None
        try:  # (verified: the whole batch's fingerprint is checked in the agreement, over every rank)
            prep = self.parts.preparer.prepare(sub, verified=True, call_args=call.fingerprint)
        except BatchError as e:
            error = e
        rows, fallback = self._agree(prep, fingerprint)
        if error is not None:
            raise error
        return prep, rows, fallback

    def _fingerprint(self, tokens: list[np.ndarray], cached: list[int], fixed: list[int | None],
                     sub: list[Request], call: PrefillCall) -> list[int]:
        """The whole batch's fingerprint (every rank of the stage computes the same from
        the same batch: the prefixes named by replica), then this replica's prefixes'
        cache handles (its own ranks compute the same); zeros with the check off."""
        if not self.parts.preparer.check_consistency:
            return [0, 0, 0, 0]
        flat = np.concatenate([t.astype(np.int64, copy=False) for t in tokens]) if tokens else np.zeros(0, np.int64)
        whole = batch_fingerprint(flat, [t.size for t in tokens], cached, [-1 if d is None else d for d in fixed],
                                  call.fingerprint)
        local = np.asarray([-1 if r.prefix is None else r.prefix.seq_id for r in sub], dtype=np.int64)
        return whole + [zlib.crc32(local.tobytes())]

    @staticmethod
    def _requests(batch: Sequence[Request]) -> list[Request]:
        """The batch as a list, once the container rule passed (before list(): a string or
        a generator is no batch)."""
        check_container(batch)
        return list(batch)

    def _lengths(self, reqs: Sequence[Request]) -> tuple[list[np.ndarray], list[int], list[int | None]]:
        """Each request's token ids, cached tokens and the replica it must go to (its
        prefix's, else None). Checked by the batch's rules that hold before it is split
        (each item a Request, its tokens a 1-D integer array: :data:`BATCH_RULES`) and the
        DP prefix's own; each replica's preparer then checks its share by the whole table."""
        tokens, cached, fixed = [], [], []
        for j, r in enumerate(reqs):
            check_item_type(r, j)
            h = r.prefix
            if h is not None and not isinstance(h, ReplicaHandle):
                raise KVHandleError(f"request {j}: under attention DP a prefix is the ReplicaHandle this engine "
                                    f"returned, got {type(h).__name__}")
            if h is not None and not 0 <= h.replica < self.replicas:
                raise KVHandleError(f"request {j}: its handle names replica {h.replica}, this engine has "
                                    f"{self.replicas}")
            tokens.append(request_tokens(r.tokens, j))
            cached.append(0 if h is None else h.num_tokens)
            fixed.append(None if h is None else h.replica)
        return tokens, cached, fixed

    def _local(self, h: ReplicaHandle | None) -> KVHandle | None:
        if h is None:
            return None
        if h.local is None:  # a handle issued on a rank of another replica: not this rank's
            raise KVHandleError(f"a ReplicaHandle of replica {h.replica} passed to a rank of replica {self.replica}; "
                                "pass each rank the handles its own engine returned")
        return h.local

    def _agree(self, prep: PreparedBatch | None, fingerprint: list[int]) -> tuple[int, str | None]:
        """:func:`agree` right after preparing: whether every rank was given its batch,
        whether every replica prepared its sub-batch (``prep`` None: this one refused), the
        largest replica's rows and whether some replica's batch rules the graphs out
        (:meth:`PrefillGraphs.own_fallback`). Every replica then runs the same path at the
        same rows, so the FFN's collectives have one size."""
        runner = self.parts.stage.runner
        if prep is None:
            mine = [1, 0, 0]
        else:
            eager = runner is not None and runner.prefill.own_fallback(prep) is not None
            mine = [0, prep.plan.max_local_rows, int(eager)]
        try:
            refused, rows, eager = agree(self.stage, self.replicas, self.device, mine, fingerprint,
                                         stages=1 if self.pipeline is None else self.pipeline.num_stages)
        except BaseException:
            if prep is not None:
                self.parts.preparer.abort(prep)
            raise
        if refused and prep is not None:
            self.parts.preparer.abort(prep)
            raise BatchError(REFUSED_ELSEWHERE)
        return rows, FALLBACK_REQUESTS if eager else None


#: what a rank raises when another replica refused its share of a forward (that replica's ranks name the request)
REFUSED_ELSEWHERE = ("another attention-DP replica refused its share of the batch (its ranks name the request); "
                     "nothing was changed")


def agree(group: CPGroup, replicas: int, device: torch.device, mine: list[int], fingerprint: list[int],
          call: str = "prefill", stages: int = 1) -> list[int]:
    """The replicas' one agreement of a forward, of either phase: one all-gather over every
    rank of ``group`` (one host sync) of this rank's figures ``mine`` and ``fingerprint``:
    the whole call's (3 values, every rank's the same) then this replica's own (every rank
    of the replica the same). ConsistencyError on every rank where one differs; else the
    largest of each of ``mine`` over the ranks (a refusal, the rows, an eager fallback);
    ``call``: what every rank must call alike (the error names it). ``group``: every rank
    of the stage, or of the pipeline's ``stages`` stages (stage-major, graphcp.mesh): a
    replica's ranks are consecutive within each stage, and its ranks of every stage hold
    the same requests."""
    row = to_device(np.array([mine + fingerprint], dtype=np.int64), device)
    every = group.all_gather_rows(row).cpu()
    n = len(mine)
    me, size = group.rank, group.size // stages
    per = size // replicas
    replica = lambda r: r % size // per  # noqa: E731
    check_fingerprints(every[:, n:n + 3], me, call=call)
    check_fingerprints(every[:, n + 3:], me, [r for r in range(group.size) if replica(r) == replica(me)], call)
    return every[:, :n].max(dim=0).values.tolist()
