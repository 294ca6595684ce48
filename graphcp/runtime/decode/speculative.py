"""Speculative decoding with an EAGLE-3 draft (``generate(..., draft_tokens=k)``,
``graphcp generate --draft DIR --draft-tokens K``; docs/speculative.md, "Decoding").

One round, for every live request at once, is one decode step of the target:

1. the step's rows are reserved: k + 1 a request, at its next k + 1 positions (the
   decode planner, ``tokens [requests, k + 1]``), each where the cache mode puts a decoded
   token;
2. the draft proposes: its first token came from its last row (the prefill's, or the
   previous round's); each next one is a draft step over one row a request at the
   reserved positions, reading its own previous row (not ``fc``'s), its layer's K/V in
   the cache as the mode stores a decoded token's (the token-sharded cache's LSE merge);
3. the target verifies the pending token and the k proposals in one step: k + 1 rows a
   request, causal among them, each rank over its share merged by LSE;
4. greedy acceptance: the longest run of proposals equal to the target's own greedy tokens,
   then the target's next token; the rejected rows are given back on every rank (every
   layer's K/V, the draft's too);
5. the draft runs again over the kept rows with the target's auxiliary hidden states (what
   a prefill's draft reads), so its K/V of every kept position is the target-fed one and
   its last row gives the next round's first proposal.

The generated ids are plain greedy decoding's, token for token, whatever the draft
proposes; a good draft only takes fewer steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from graphcp.errors import BatchError


@dataclass
class SpeculativeStats:
    """What the draft saved (``GenerateOutput.speculative``)."""

    draft_tokens: int
    steps: int = 0  # verify steps run
    proposed: int = 0  # draft tokens proposed, summed over requests and steps
    accepted: int = 0  # of them, the ones the target's greedy tokens confirmed (and kept)
    tokens: int = 0  # tokens the decode steps generated, summed over requests
    request_steps: int = 0  # (request, step) pairs
    plain_steps: int = 0  # the decode steps plain greedy decoding runs for the same tokens

    def summary(self) -> dict:
        rs = max(self.request_steps, 1)
        return {"draft_tokens": self.draft_tokens, "steps": self.steps, "proposed": self.proposed,
                "accepted": self.accepted, "acceptance_rate": self.accepted / max(self.proposed, 1),
                "accepted_per_step": self.accepted / rs, "tokens_per_step": self.tokens / rs,
                "steps_per_token": rs / max(self.tokens, 1), "plain_steps": self.plain_steps,
                "steps_saved": self.plain_steps - self.steps}


def round_tokens(k: int, live: list, context: int) -> int:
    """The draft tokens of a round: ``k``, fewer when a request needs fewer tokens (its
    budget) or has fewer positions left before the model's context; 0: a plain step."""
    need = min(s.most - len(s.tokens[-1]) for s in live)
    room = min(context - s.handle.num_tokens for s in live)
    return max(0, min(k, need - 1, room - 1))


def check_draft_tokens(engine, k) -> int:
    """``k`` checked: at least 1, at most the largest decode bucket less one (a request's
    verify rows fit a graph), on an engine with a draft; BatchError otherwise."""
    from graphcp.checks import check_int

    most = engine.parts.decoder.most_rows - 1
    k = check_int(k, "draft_tokens", lo=1, hi=most, where="generate", err=BatchError)
    if engine.parts.drafter is None:
        raise BatchError("generate: draft_tokens needs an engine with an EAGLE-3 draft (RuntimeConfig.draft)")
    return k


@dataclass
class Proposal:
    """A request's draft state between rounds: its first proposal and the draft's last row."""

    first: int
    hidden: torch.Tensor  # [hidden]: the draft's row before its norm


def first_proposals(out) -> list[Proposal]:
    """Each request's proposal after a prefill with a draft (its DraftOutput)."""
    d = out.draft
    best = d.draft_to_target.index_select(0, d.logits.argmax(dim=-1)).tolist()
    return [Proposal(int(b), d.hidden[j]) for j, b in enumerate(best)]


def _accepted(tokens: np.ndarray, target: np.ndarray) -> np.ndarray:
    """int64 [B]: per request the length of the run of proposals (``tokens[:, 1:]``) equal to
    the target's greedy tokens of the rows before them (``target[:, :-1]``)."""
    same = tokens[:, 1:] == target[:, :-1]
    return np.cumprod(same, axis=1).sum(axis=1).astype(np.int64)


def speculative_round(engine, live: list, proposals: list[Proposal], k: int, budget: np.ndarray,
                      stop: frozenset, stats: SpeculativeStats, keep_logits: bool) -> list[list[int]]:
    """One round over ``live`` (generate's request states: ``handle``, ``pending``): the
    tokens each request takes (at most ``budget[j]``, cut after a stop token), its handle
    and pending token and ``proposals`` moved on. ``k``: draft tokens this round (0: a
    plain step through the same path)."""
    dec, drafter = engine.parts.decoder, engine.parts.drafter
    planner, device = dec.preparer, engine.parts.body.device
    t0 = time.perf_counter()
    B, n = len(live), k + 1
    toks = np.empty((B, n), dtype=np.int64)
    toks[:, 0] = [s.pending for s in live]
    toks[:, 1:] = np.array([p.first for p in proposals], dtype=np.int64)[:, None]  # placeholders until proposed
    prep = planner.prepare([s.handle for s in live], toks, (1,))
    base = np.arange(B, dtype=np.int64) * n
    try:
        x = torch.stack([p.hidden for p in proposals]).to(device)
        for i in range(1, k):  # proposal i + 1 from a draft step at row i - 1 (position of token i - 1)
            sub = planner.rows(prep, base + i - 1, toks[:, i])
            nxt, x = drafter.decode_rows(sub, x, own=True)
            toks[:, i + 1] = nxt.numpy()
        prep.ids[:] = toks.reshape(-1)
    except BaseException:
        planner.abort(prep)
        raise
    # the decode graph of the step's rows where one holds them (it copies the draft's inputs out)
    logits, res = dec.run(prep, False, drafter.draft.aux_layer_ids)
    target = logits.argmax(dim=-1).view(B, n).cpu().numpy()  # (the [rows, vocab] logits stay on the device)
    kept_logits = logits.view(B, n, -1).cpu() if keep_logits else None
    run = _accepted(toks, target)
    take = np.minimum(run + 1, budget)
    for j in range(B):  # a stop token ends the request there
        hit = [i for i in range(int(take[j])) if int(target[j, i]) in stop]
        if hit:
            take[j] = hit[0] + 1
    planner.accept(prep, take)
    out = []
    for j, s in enumerate(live):
        got = target[j, : take[j]].tolist()
        out.append(got)
        s.handle, s.pending = engine.parts.kv.handle(s.handle.seq_id), got[-1]
        if keep_logits:
            s.logits[-1].extend(kept_logits[j, : take[j]])
    kept = np.concatenate([base[j] + np.arange(take[j]) for j in range(B)])
    ids = target.reshape(-1)[kept]  # each kept row's next token: the draft's input there
    aux = res.aux_rows[: prep.rows].flatten(1).index_select(0, torch.from_numpy(kept).to(device))
    nxt, pre = drafter.decode_rows(planner.rows(prep, kept, ids), aux, own=False)
    last = np.cumsum(take) - 1
    for j, s in enumerate(live):
        proposals[j] = Proposal(int(nxt[last[j]]), pre[last[j]])
        drafter.next_token[s.handle.seq_id] = s.pending  # its last draft row took the pending token
    accepted = int((take - 1).sum())
    res.info.stats.update(draft_tokens=k, accepted_tokens=accepted, rows_per_request=n,
                          time_s=time.perf_counter() - t0)  # (the round: draft steps, verify, re-draft)
    engine.parts.recorder.record(prep, res.info)
    stats.steps += 1
    stats.proposed += k * B
    stats.accepted += accepted
    stats.tokens += int(take.sum())
    stats.request_steps += B
    return out
