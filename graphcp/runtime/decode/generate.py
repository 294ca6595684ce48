"""Greedy generation and conversations over ``prefill`` and ``decode``
(``PrefillEngine.generate``, ``graphcp generate``; docs/decode.md).

A request is a :class:`Conversation`: its turns (token ids each), every turn prefilled
after what the request holds so far (the previous turn's prompt and generated tokens; the
last generated token, whose K/V no step has computed yet, first), then up to
``max_new_tokens`` tokens generated greedily, one decode step each, until a stop token
(kept, as transformers keeps its end-of-sequence token). A plain request is one turn.
Every turn of every request runs in one batch: one prefill, then decode steps over the
requests still generating. SPMD: every rank calls it with the same arguments and returns
the same tokens.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable as IterableABC
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from graphcp.checks import check_int, check_turns
from graphcp.errors import BatchError
from graphcp.runtime.batch import Request, check_vocabulary, request_tokens
from graphcp.runtime.decode.speculative import (
    SpeculativeStats,
    check_draft_tokens,
    first_proposals,
    round_tokens,
    speculative_round,
)
from graphcp.runtime.progress import progress_bar


@dataclass
class Conversation:
    """One request of :meth:`~graphcp.runtime.engine.PrefillEngine.generate`: its turns, in
    order (none empty), and the most tokens generated after each (None: the
    call's ``max_new_tokens``); ``prefix``: the first turn's first tokens to prefill in a
    forward of their own first (a cached prefix, as ``graphcp prefill``'s ``prefix``)."""

    turns: Sequence[Any]
    max_new_tokens: int | None = None
    prefix: int = 0


@dataclass
class GenerateOutput:
    """Per request (in input order), per turn: the generated ids, why generation stopped
    (``stop``: a stop token; ``length``: max_new_tokens), and with ``logits`` asked each
    step's logits, float32 ``[steps, vocab]`` (the prefill's last row, then each decode
    step's); ``handles``: each request's KV when kept (``release=False``), else None. A
    kept handle holds every token but the last generated one (no step has computed its
    K/V): a next prefill extending it starts with that token."""

    tokens: list[list[list[int]]]
    finish: list[list[str]]
    logits: list[list[torch.Tensor]] | None = None
    handles: list | None = None
    #: decode steps run (over all turns)
    steps: int = 0
    #: with ``draft_tokens``: what the draft saved (SpeculativeStats.summary: acceptance rate,
    #: tokens a step, steps saved); None without
    speculative: dict | None = None


@dataclass(eq=False)  # (compared by identity: a request is itself)
class _State:
    """One request while it generates."""

    turns: list[np.ndarray]
    most: int  # tokens generated a turn, at most
    prefix: int
    handle: Any = None
    owned: bool = False  # the handle is one generate's prefill returned (a caller's prefix is not released on failure)
    pending: int | None = None  # the last generated token, not in the cache yet
    tokens: list[list[int]] = field(default_factory=list)
    logits: list[list[torch.Tensor]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)

    def done(self, stop: frozenset) -> bool:
        toks = self.tokens[-1]
        return toks[-1] in stop or len(toks) >= self.most


def conversations(requests: Any, max_new_tokens: int, vocab: int, context: int) -> list[_State]:
    """Each request as a conversation, checked before anything runs (BatchError naming the
    request and turn): token ids of the vocabulary, a non-empty first turn, and room for
    every turn and its most generated tokens within the model's context."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, SequenceABC) or not requests:
        raise BatchError("generate: requests must be a non-empty list of token ids, Requests or Conversations")
    out = []
    for j, r in enumerate(requests):
        conv = r if isinstance(r, Conversation) else Conversation([r.tokens if isinstance(r, Request) else r])
        if isinstance(conv.turns, (str, bytes)) or not isinstance(conv.turns, SequenceABC) or not conv.turns:
            raise BatchError(f"generate: request {j}: turns must be a non-empty list of token-id lists")
        turns = [request_tokens(t, j).astype(np.int64) for t in conv.turns]
        check_vocabulary(turns, vocab, lambda t, j=j: f"generate: request {j}, turn {t}")
        most = max_new_tokens if conv.max_new_tokens is None else check_int(
            conv.max_new_tokens, f"request {j}: max_new_tokens", lo=1, where="generate", err=BatchError)
        check_turns([t.size for t in turns], f"generate: request {j}", BatchError)
        prefix = check_int(conv.prefix, f"request {j}: prefix", lo=0, hi=turns[0].size - 1, where="generate",
                           err=BatchError)
        handle = r.prefix if isinstance(r, Request) else None  # a cached prefix it extends (prefill checks it)
        cached = 0 if handle is None else getattr(handle, "num_tokens", 0)
        need = cached + sum(t.size for t in turns) + len(turns) * most
        if need > context:
            raise BatchError(f"generate: request {j}: {cached + sum(t.size for t in turns)} cached and prompt tokens "
                             f"and up to {len(turns)} x {most} generated exceed the model's context of {context}")
        out.append(_State(turns, most, prefix, handle))
    return out


def stop_tokens(stop: Any, vocab: int, name: str = "generate: stop") -> frozenset[int]:
    """``stop`` as a set of token ids (None: none), each in the vocabulary; BatchError
    naming ``name`` (the argument, or the flag that gave it) otherwise. A bare id is
    refused: ``stop=879`` is a list of one."""
    if stop is None:
        return frozenset()
    if isinstance(stop, (str, bytes)) or not isinstance(stop, IterableABC):
        one = f"; one stop token is [{stop!r}]" if _token_id(stop) is not None else ""
        raise BatchError(f"{name} must be a list of token ids, got {type(stop).__name__} {stop!r}"[:300] + one)
    given = list(stop)
    ids = [_token_id(t) for t in given]
    if None in ids:
        raise BatchError(f"{name} must be a list of token ids, got an item {given[ids.index(None)]!r}"[:300])
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BatchError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
    return frozenset(ids)


def _token_id(t: Any) -> int | None:
    """``t`` as an int (numpy's and torch's integers too), or None (a bool is no id)."""
    if isinstance(t, bool):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None


def _prefill_turn(engine, states: list[_State], t: int, stop: frozenset, keep_logits: bool,
                  proposals: dict | None = None) -> list[_State]:
    """Turn ``t`` of the requests that have it: one prefill of every prompt after its
    pending token, the first generated token of each. The requests still generating."""
    live = [s for s in states if t < len(s.turns)]
    if t == 0 and any(s.prefix for s in live):  # cached prefixes first, a forward of their own
        withp = [s for s in live if s.prefix]
        out = engine.prefill([Request(s.turns[0][: s.prefix], s.handle) for s in withp], aux_hidden_layers=())
        for s, h in zip(withp, out.handles):
            s.handle, s.owned = h, True
    reqs = []
    for s in live:
        new = s.turns[t][s.prefix:] if t == 0 else s.turns[t]
        reqs.append(Request(new if s.pending is None else np.concatenate([[s.pending], new]), s.handle))
    out = engine.prefill(reqs, aux_hidden_layers=())
    first = out.last_logits.argmax(-1).tolist()
    if proposals is not None:  # the draft's first proposal of each request, from its last row
        proposals.update(zip(map(id, live), first_proposals(out)))
    for j, (s, h) in enumerate(zip(live, out.handles)):
        s.handle, s.owned, s.pending = h, True, first[j]
        s.tokens.append([first[j]])
        s.logits.append([out.last_logits[j]] if keep_logits else [])
    return [s for s in live if not s.done(stop)]


def _decode_turn(engine, live: list[_State], stop: frozenset, keep_logits: bool, bar) -> int:
    """Decode steps until every request of the turn stopped; the steps run. Each step's
    next tokens and stop tests come from the device (the logits only when kept)."""
    steps = 0
    while live:
        out = engine.parts.decoder.decode([s.handle for s in live], [s.pending for s in live], logits=keep_logits,
                                    stop=stop or None)
        nxt = out.tokens.tolist()
        hit = out.stopped.tolist() if out.stopped is not None else [False] * len(nxt)
        ended = []
        for j, (s, h) in enumerate(zip(live, out.handles)):
            s.handle, s.pending = h, nxt[j]
            s.tokens[-1].append(nxt[j])
            if keep_logits:
                s.logits[-1].append(out.logits[j])
            ended.append(hit[j] or len(s.tokens[-1]) >= s.most)
        live = [s for s, e in zip(live, ended) if not e]
        steps += 1
        if bar is not None:
            bar.update(1)
    return steps


def _speculative_turn(engine, live: list[_State], stop: frozenset, keep_logits: bool, bar, k: int,
                      proposals: dict, stats: SpeculativeStats) -> int:
    """Verify steps of ``k`` draft tokens (graphcp.runtime.decode.speculative) until every
    request of the turn stopped; the steps run."""
    steps = 0
    while live:
        props = [proposals[id(s)] for s in live]
        budget = np.array([s.most - len(s.tokens[-1]) for s in live], dtype=np.int64)
        got = speculative_round(engine, live, props, round_tokens(k, live, engine.max_context), budget, stop, stats,
                                keep_logits)
        for s, toks, p in zip(live, got, props):
            s.tokens[-1].extend(toks)
            proposals[id(s)] = p
        live = [s for s in live if not s.done(stop)]
        steps += 1
        if bar is not None:
            bar.update(1)
    return steps


def generate(engine, requests: Any, max_new_tokens: int, stop: Sequence[int] | None = None,
             logits: bool = False, release: bool = True, progress: bool = False,
             draft_tokens: int | None = None) -> GenerateOutput:
    """See the module doc (``engine``: a PrefillEngine). ``draft_tokens``: speculative
    decoding with the engine's EAGLE-3 draft, k proposals a step
    (graphcp.runtime.decode.speculative); the same tokens, fewer steps."""
    # before the first prefill: nothing runs that decode would refuse
    engine.parts.decoder.check_combination("PrefillEngine.generate")
    k = None if draft_tokens is None else check_draft_tokens(engine, draft_tokens)
    spec = None if k is None else SpeculativeStats(k)
    proposals = None if k is None else {}
    most = check_int(max_new_tokens, "max_new_tokens", lo=1, where="generate", err=BatchError)
    stops = stop_tokens(stop, engine.cfg.vocab_size)
    states = conversations(requests, most, engine.cfg.vocab_size, engine.max_context)
    turns = max(len(s.turns) for s in states)
    # the steps when no stop token comes: a turn's steps serve all its requests at once
    total = sum(max(s.most - 1 for s in states if t < len(s.turns)) for t in range(turns))
    bar, steps = None, 0
    try:
        for t in range(turns):
            live = _prefill_turn(engine, states, t, stops, logits, proposals)
            if t == 0:  # shown from the first step: a batch the prefill refuses is one line on stderr
                bar = progress_bar(progress and engine.world_rank == 0, desc="decode steps", unit="step",
                                   total=total)
            for s in states:
                if t < len(s.turns) and s not in live:
                    s.finish.append("stop" if s.tokens[-1][-1] in stops else "length")
            if spec is not None:
                steps += _speculative_turn(engine, live, stops, logits, bar, k, proposals, spec)
                # plain greedy decoding: one step a token after the prefill's, the longest request's
                spec.plain_steps += max((len(s.tokens[-1]) - 1 for s in live), default=0)
            else:
                steps += _decode_turn(engine, live, stops, logits, bar)
            for s in live:
                s.finish.append("stop" if s.tokens[-1][-1] in stops else "length")
    except BaseException:
        _release(engine, states)
        raise
    finally:
        if bar is not None:
            bar.close()
    handles = None if release else [s.handle for s in states]
    if release:
        _release(engine, states)
    return GenerateOutput([s.tokens for s in states], [s.finish for s in states],
                          [[torch.stack(x) for x in s.logits] for s in states] if logits else None, handles, steps,
                          None if spec is None else spec.summary())


def _release(engine, states: list[_State]) -> None:
    for s in states:
        if s.owned:
            engine.release(s.handle)
            s.handle, s.owned = None, False
