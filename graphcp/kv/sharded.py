"""The token-sharded KV cache: each CP rank stores only its own zigzag blocks.

For every forward (every chunk of a chunked prefill) rank ``r`` stores the KV of
its early block ``r`` and late block ``2C-1-r`` of each request's new tokens, and
nothing else, so a request's cached prefix is spread over the ranks and a rank's
pool holds about ``1/C`` of every request. Within a rank a request's positions are
stored in increasing order (local index 0, 1, ...: its blocks of the first chunk,
then of the next, ...), in that rank's own pages.

Every rank keeps the same *ledger*: for each live request, the chunks that wrote it
and how many positions each rank holds (the zigzag rule decides, from the lengths
alone). From it each rank knows every other rank's holdings and page use without
asking: admission checks every rank's pool and refuses a batch the same way on all
of them (``KVCacheFull`` naming the rank, its free pages and what the batch needs),
and the ring attention knows what each rank sends. ``RuntimeConfig.kv_tokens`` is
one rank's pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphcp.cp.zigzag import rank_token_counts
from graphcp.kv.paged import KVCacheFull, KVHandle, KVHandleError, PagedKVCache
from graphcp.kv.spans import KVSpan, position_spans


@dataclass
class _Shares:
    """The ledger entry of one live request (the same on every rank)."""

    rank_tokens: np.ndarray  # int64 [C]: positions each rank holds
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (cached, new) of each forward

    @property
    def total(self) -> int:
        return int(self.rank_tokens.sum())


class ShardedKVCache(PagedKVCache):
    """Rank ``rank``'s pool of a token-sharded cache over ``cp_size`` ranks (see the
    module doc). The allocator of :class:`PagedKVCache` manages this rank's pages
    (its sequences count the positions stored here); ``extend``, ``rollback``,
    ``release`` and the handles speak in whole requests, as for a replicated cache."""

    def __init__(self, *args, cp_size: int, rank: int, **kw) -> None:
        super().__init__(*args, **kw)
        if not 0 <= rank < cp_size:
            raise ValueError(f"rank must be in [0, {cp_size}), got {rank}")
        self.cp_size, self.rank = cp_size, rank
        self._shares: dict[int, _Shares] = {}
        #: pages each rank's pool has handed out (scratch excluded), from the ledger
        self._used = np.zeros(cp_size, dtype=np.int64)

    # ---- capacity ---------------------------------------------------------------
    @property
    def rank_capacity_tokens(self) -> int:
        """Tokens one rank's pool holds (what ``kv_tokens`` sized)."""
        return super().capacity_tokens

    @property
    def capacity_tokens(self) -> int:
        """Tokens the C pools hold together: a request longer than this fits no
        sharding (``extend`` checks each rank's pool exactly)."""
        return self.cp_size * super().capacity_tokens

    @property
    def num_free_pages(self) -> int:
        """The fewest free pages of any rank: what a batch planned the same way on every
        rank can count on (this rank's own: :attr:`rank_free_pages`)."""
        return int(self.num_pages - 1 - self._used.max())

    def rank_free_pages(self) -> np.ndarray:
        """int64 [C]: free pages of every rank's pool."""
        return self.num_pages - 1 - self._used

    def _request_tokens(self, seq_id: int) -> int:
        return self._shares[seq_id].total

    # ---- allocation -------------------------------------------------------------
    def extend(self, prefixes: "list[KVHandle | None]", new_tokens: list[int]) -> list[int]:
        """Reserve, on every rank, each request's share of ``new_tokens[i]`` more tokens
        after ``prefixes[i]``; all or nothing, and the same outcome on every rank."""
        if len(prefixes) != len(new_tokens):
            raise ValueError("prefixes and new_tokens must have the same length")
        counts = rank_token_counts(self.cp_size, np.asarray(new_tokens, dtype=np.int64))  # [C, R]
        held = np.zeros_like(counts)
        seen: set[int] = set()
        for i, h in enumerate(prefixes):
            if h is not None:
                self.check_handle(h)
                if h.seq_id in seen:
                    raise KVHandleError(f"KV handle seq_id={h.seq_id} is the prefix of two requests in one batch")
                seen.add(h.seq_id)
                held[:, i] = self._shares[h.seq_id].rank_tokens
        self._check_room(held, counts)
        ids = super().extend(prefixes, counts[self.rank].tolist())
        for i, (sid, h) in enumerate(zip(ids, prefixes)):
            sh = self._shares.get(sid)
            if sh is None:
                sh = self._shares[sid] = _Shares(np.zeros(self.cp_size, dtype=np.int64))
            sh.chunks.append((0 if h is None else h.num_tokens, int(new_tokens[i])))
            sh.rank_tokens = sh.rank_tokens + counts[:, i]
        self._used += self._pages(held + counts).sum(axis=1) - self._pages(held).sum(axis=1)
        return ids

    def _pages(self, tokens: np.ndarray) -> np.ndarray:
        return -(-tokens // self.page_size)

    def _check_room(self, held: np.ndarray, counts: np.ndarray) -> None:
        """KVCacheFull (on every rank alike) unless every rank's pool takes its share."""
        after = self._pages(held + counts)  # [C, R]
        width = self.table_width
        if (after > width).any():
            k, j = (int(x[0]) for x in np.nonzero(after > width))
            raise KVCacheFull(
                f"KV cache full: request {j} needs {int(after[k, j])} pages of {self.page_size} tokens on rank {k}, "
                f"the page table holds at most {width} per sequence"
            )
        need = after.sum(axis=1) - self._pages(held).sum(axis=1)
        free = self.rank_free_pages()
        short = np.flatnonzero(need > free)
        if short.size:
            k = int(short[np.argmax((need - free)[short])])
            raise KVCacheFull(
                f"KV cache full on rank {k}: the batch needs {int(need[k])} more pages of {self.page_size} tokens "
                f"there, {int(free[k])} are free (one rank's pool: {self.num_pages - 1} usable pages, "
                f"{self.rank_capacity_tokens} tokens; the sharded cache spreads each request over {self.cp_size} pools)"
            )

    def rollback(self, seq_ids: list[int], new_tokens: list[int]) -> None:
        for sid in reversed(seq_ids):
            sh = self._shares[sid]
            cached, new = sh.chunks.pop()
            counts = rank_token_counts(self.cp_size, np.array([new], dtype=np.int64))[:, 0]
            before = sh.rank_tokens - counts
            self._used -= self._pages(sh.rank_tokens) - self._pages(before)
            sh.rank_tokens = before
            dropped = not sh.chunks
            if dropped:
                del self._shares[sid]
            self._shrink(sid, int(counts[self.rank]), drop=dropped)

    def release(self, handle: KVHandle) -> None:
        super().release(handle)  # checks the handle, frees this rank's pages
        sh = self._shares.pop(handle.seq_id)
        self._used -= self._pages(sh.rank_tokens)

    def handle(self, seq_id: int) -> KVHandle:
        sh = self._shares[seq_id]
        return KVHandle(seq_id, sh.total, tuple(self._seqs[seq_id].pages), self.cache_id, "sharded",
                        self.cp_size, tuple(sh.chunks), tuple(int(x) for x in sh.rank_tokens))

    def snapshot(self) -> tuple:
        ledger = tuple((k, tuple(v.chunks), tuple(v.rank_tokens.tolist())) for k, v in sorted(self._shares.items()))
        return super().snapshot() + (ledger, tuple(self._used.tolist()))

    # ---- what the ring reads ----------------------------------------------------
    def rank_tokens(self, seq_ids: list[int]) -> np.ndarray:
        """int64 [C, len(seq_ids)]: positions each rank holds of these live sequences."""
        if not seq_ids:
            return np.zeros((self.cp_size, 0), dtype=np.int64)
        return np.stack([self._shares[s].rank_tokens for s in seq_ids], axis=1)

    def rank_used_pages(self) -> np.ndarray:
        """int64 [C]: pages every rank's pool has handed out (the ledger's count)."""
        return self._used.copy()


    # ---- export (graphcp.kv.spans.KVSource) --------------------------------------
    def kv_spans(self, handle: KVHandle, cp_size: int) -> list[KVSpan]:
        """Per layer, one span per run of consecutive positions a rank stores (its zigzag
        blocks of every forward that wrote the request, adjacent blocks merged), owned by
        that rank, in position order: each rank exports what it holds, nothing else."""
        return position_spans(self.num_layers, [handle.positions(r) for r in range(cp_size)], self.first_layer)

    def holds(self, span: KVSpan, rank: int) -> bool:
        return rank == span.owner

    def local_index(self, handle: KVHandle, position: int) -> int:
        """This rank's local index of ``position``: its rank in the (increasing) positions
        this rank stores; ValueError when another rank holds it."""
        held = handle.positions(self.rank)
        i = int(np.searchsorted(held, position))
        if i == len(held) or held[i] != position:
            raise ValueError(f"rank {self.rank} does not hold position {position} of sequence {handle.seq_id} "
                             "(the token-sharded cache keeps each position on one rank)")
        return i


def make_kv_cache(sharded: bool, cp_size: int, rank: int, *args, **kw) -> PagedKVCache:
    """The rank's cache: a replicated pool, or this rank's pool of a sharded one."""
    if sharded:
        return ShardedKVCache(*args, cp_size=cp_size, rank=rank, **kw)
    return PagedKVCache(*args, **kw)

