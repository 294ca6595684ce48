"""The draft phase of a prefill with an EAGLE-3 draft (``RuntimeConfig.draft``,
docs/speculative.md): after the target's body, over the same rows on the same ranks.

The draft's inputs are aligned with the target's rows (graphcp.model.eagle3.shift): its
ids are the batch's ids shifted per request before sharding, its hidden states the
target's auxiliary rows this rank already holds, so nothing but the draft's own K/V
moves (its attention exchanges K/V like any layer's). The outputs are combined across
ranks like the target's: every rank returns the same ``DraftOutput``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.staging import to_device
from graphcp.dist import CPGroup
from graphcp.model.eagle3.layer import Eagle3Draft
from graphcp.model.eagle3.shift import draft_input_ids
from graphcp.model.forward_context import KV_RECEIVED
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import DraftOutput, PreparedBatch, check_draft_next
from graphcp.runtime.body import Body
from graphcp.runtime.capture.draft_graphs import DraftGraphs

#: ForwardInfo.stats keys of the draft phase (the stats file lists them per forward)
#: target hidden states moved to feed the draft: none, by alignment (the draft reads its rank's
#: own rows; tests/test_eagle3.py records the phase's collectives and finds none of hidden width)
STAT_INPUT_BYTES = "draft_hidden_bytes_received"
STAT_KV_RECEIVED = "draft_kv_bytes_received"  # the draft layer's K/V exchange (all-gather, ring, prefix fetch)
STAT_KV_STORED = "draft_kv_bytes_stored"  # the draft layer's K/V this rank's cache stored for the batch


@dataclass
class DraftRunner:
    draft: Eagle3Draft
    body: Body
    group: CPGroup
    device: torch.device
    #: the draft's graphs (graph modes; None: it runs eagerly)
    graphs: DraftGraphs | None = None

    def __post_init__(self) -> None:
        #: the token each live sequence's last draft row took (a chunk extending it must start with it)
        self.next_token: dict[int, int] = {}

    def with_input_layers(self, aux: tuple[int, ...]) -> tuple[int, ...]:
        """The asked auxiliary layers, then the draft's input layers not among them."""
        return aux + tuple(dict.fromkeys(i for i in self.draft.aux_layer_ids if i not in aux))

    def after_target(self, prep: PreparedBatch, batch, layers: tuple[int, ...], target, last_logits: torch.Tensor,
                     draft_next: np.ndarray, all_logits: bool) -> DraftOutput:
        """The draft over this rank's rows after the target's forward ``target`` (its
        StageResult, whose auxiliary rows hold ``layers``): its inputs the target's rows
        of its layers, in the checkpoint's order, and the batch's shifted ids; a request's
        next token ``draft_next``, or the target's greedy one (-1)."""
        nxt = np.where(draft_next >= 0, draft_next, last_logits.argmax(dim=-1).numpy())
        flat = np.concatenate([np.asarray(r.tokens, dtype=np.int64).reshape(-1) for r in batch])
        info = target.info
        if info.path == "graph":  # the draft's graph reads the bucket's static rows
            return self.run(prep, flat, None, nxt, all_logits, info.stats, info.capacity)
        cols = to_device(np.array([layers.index(i) for i in self.draft.aux_layer_ids], dtype=np.int64), self.device)
        hidden = target.aux_rows.index_select(1, cols).flatten(1)  # [rows, 3 * hidden]: fc's input, this rank's rows
        return self.run(prep, flat, hidden, nxt, all_logits, info.stats)

    def remember(self, seq_ids: list[int], out: DraftOutput) -> None:
        """The token each sequence's last draft row took (what extending it must start with)."""
        self.next_token.update(zip(seq_ids, out.next_tokens.tolist()))

    def forget(self, seq_id: int) -> None:
        self.next_token.pop(seq_id, None)

    @property
    def layer(self) -> int:
        """The draft layer's index in the cache (after the target's layers)."""
        return self.draft.layer_index

    def run(self, prep: PreparedBatch, flat: np.ndarray, hidden: torch.Tensor | None, next_tokens: np.ndarray,
            all_logits: bool, stats: dict, bucket: int | None = None) -> DraftOutput:
        """The draft over this rank's rows of ``prep`` (``flat``: the batch's ids in batch
        order; ``hidden``: [>= rows, 3 * hidden] the target's states of this rank's rows;
        ``next_tokens``: int64 [R], the token after each request's last new token).
        ``bucket``: the target replayed this bucket's graph: the draft replays its own
        (reading the target's static rows). Adds the phase's figures to ``stats``."""
        plan = prep.plan
        ids = draft_input_ids(flat, plan.extend_lens, next_tokens, plan.rank(self.group.rank).rows)
        phase: dict = {}
        if bucket is not None and self.graphs is not None:
            normed, pre = self.graphs.replay(prep, bucket, ids, phase)
        else:
            normed, pre = self._eager(prep, ids, hidden, phase)
        stats[STAT_INPUT_BYTES] = 0
        stats[STAT_KV_RECEIVED] = phase.get(KV_RECEIVED, 0)
        stats[STAT_KV_STORED] = self._stored(prep)
        return self._outputs(prep, normed, pre, next_tokens, all_logits)

    def _eager(self, prep: PreparedBatch, ids: np.ndarray, hidden: torch.Tensor,
               phase: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft run eagerly on the largest rank's rows, padded as the body pads them."""
        n, capacity, dev = prep.ids.shape[0], prep.plan.max_local_rows, self.device
        rows = np.zeros((3, capacity), dtype=np.int64)  # ids, positions, slots: one upload
        rows[2, n:] = -1
        rows[0, :n], rows[1, :n], rows[2, :n] = ids, prep.positions, prep.slots
        x = torch.zeros(capacity, hidden.shape[1], dtype=hidden.dtype, device=dev)
        x[:n].copy_(hidden[:n])  # this rank's own rows: no collective feeds the draft
        with nvtx_range("draft", category="eager"):
            ids_t, pos_t, slots_t = to_device(rows, dev)
            ctx = self.body.context(prep, slots_t, stats=phase)
            return self.draft(ids_t, pos_t, x, ctx)

    def decode_rows(self, prep: PreparedBatch, x: torch.Tensor, own: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over a decode-phase batch's rows (graphcp.runtime.decode.speculative: a
        proposal a request, or the rows a verify step kept), the same on every rank: its
        layer's K/V stored and attended as the cache mode's decode phase does (the token-sharded
        cache's LSE merge). ``x``: the target's auxiliary rows [rows, 3 * hidden] in the draft's
        order (through ``fc``), or with ``own`` the draft's own rows before its norm [rows,
        hidden]. Returns the target ids it proposes (int64 [rows], the draft vocabulary mapped
        by ``d2t``) and its rows before the norm (what the next proposal reads)."""
        rows = np.stack([prep.ids, prep.positions, prep.slots])
        with nvtx_range("draft_decode", category="eager"):
            ids_t, pos_t, slots_t = to_device(rows, self.device)
            ctx = self.body.context(prep, slots_t, stats={})
            normed, pre = self.draft(ids_t, pos_t, x.to(self.draft.dtype), ctx, own=own)
            best = self.draft.logits(normed).argmax(dim=-1)
            return self.draft.draft_to_target.index_select(0, best).cpu(), pre

    def _stored(self, prep: PreparedBatch) -> int:
        """Bytes of the draft layer's K/V this rank's cache stored for the batch's new tokens
        (as many of them as its cache mode keeps here)."""
        kv = self.body.kv
        tokens = kv.stored_tokens_of(self.layer, prep.plan.num_tokens, prep.ids.shape[0])
        return tokens * kv.token_values(self.layer) * kv.pool.element_size()

    def _outputs(self, prep: PreparedBatch, normed: torch.Tensor, pre: torch.Tensor, next_tokens: np.ndarray,
                 all_logits: bool) -> DraftOutput:
        plan = prep.plan
        mine = np.flatnonzero(plan.last_owner == self.group.rank)
        h = normed.shape[1]
        last = torch.zeros(plan.num_requests, 2 * h, dtype=normed.dtype, device=self.device)
        if mine.size:
            where, idx = to_device(np.stack([mine, plan.last_local_index[mine]]), self.device)
            last[where] = torch.cat([normed, pre], dim=1).index_select(0, idx)
        self.group.all_reduce_(last)  # the owners' rows; zeros elsewhere
        per_token = None
        if all_logits:
            everyone = self.group.all_gather_rows(normed.contiguous())
            order = to_device(plan.gather_index(normed.shape[0]), self.device)
            per_token = list(torch.split(self.draft.logits(everyone.index_select(0, order)).cpu(),
                                         plan.extend_lens.tolist()))
        return DraftOutput(self.draft.logits(last[:, :h]).cpu(), self.draft.draft_to_target.cpu(),
                           last[:, h:].float().cpu(), torch.from_numpy(np.asarray(next_tokens, dtype=np.int64)),
                           per_token)


def draft_next_tokens(drafter: DraftRunner | None, batch, given, m: int, vocab: int,
                      cache_id: str) -> np.ndarray | None:
    """The checked ``draft_next`` of a prefill call (-1: the target's greedy token), or None
    without a draft (graphcp.runtime.batch.check_draft_next, beside the batch's rules);
    ``cache_id``: the engine's cache, whose handles the draft's tokens are of."""
    return check_draft_next(batch, given, m, drafting=drafter is not None, vocab_size=vocab,
                            draft_tokens={} if drafter is None else drafter.next_token, cache_id=cache_id)
