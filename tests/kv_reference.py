"""The KV allocators as they were before the batch-at-once rewrite (issue 30): one
request at a time, a Python free list and page lists. The property tests run them
side by side with graphcp's caches and compare every observable: the free list (its
order included), each live sequence's tokens and pages, the sharded ledger, the
handles and the refusals' messages. Only the allocator is kept (no pool tensor)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphcp.cp.zigzag import rank_token_counts
from graphcp.kv.handle import KVCacheFull, KVHandle, KVHandleError


@dataclass
class _Sequence:
    num_tokens: int
    pages: list[int] = field(default_factory=list)


class ReferenceAllocator:
    """The old PagedKVCache's allocator (per-request extend, rollback, release)."""

    def __init__(self, num_pages: int, page_size: int, width: int, cache_id: str) -> None:
        self.num_pages, self.page_size, self.width, self.cache_id = num_pages, page_size, width, cache_id
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0

    def pages_for(self, n: int) -> int:
        return -(-n // self.page_size)

    def check_handle(self, handle: KVHandle) -> None:
        if not isinstance(handle, KVHandle):
            raise KVHandleError("not a handle")
        if handle.cache_id != self.cache_id:
            raise KVHandleError("another cache")
        if handle.seq_id not in self._seqs:
            raise KVHandleError("not live")
        if self._request_tokens(handle.seq_id) != handle.num_tokens:
            raise KVHandleError("stale")

    def _request_tokens(self, seq_id: int) -> int:
        return self._seqs[seq_id].num_tokens

    def extend(self, prefixes, new_tokens: list[int]) -> list[int]:
        seen: set[int] = set()
        need = 0
        for i, (h, n) in enumerate(zip(prefixes, new_tokens)):
            have = 0
            if h is not None:
                self.check_handle(h)
                if h.seq_id in seen:
                    raise KVHandleError("twice")
                seen.add(h.seq_id)
                have = self._seqs[h.seq_id].num_tokens
            total = self.pages_for(have + n)
            if total > self.width:
                what = "a new sequence" if h is None else f"sequence {h.seq_id}"
                raise KVCacheFull(
                    f"KV cache full: request {i} ({what}, {have} + {n} tokens) needs {total} pages of "
                    f"{self.page_size} tokens, the page table holds at most {self.width} per sequence"
                )
            need += total - self.pages_for(have)
        if need > len(self._free):
            raise KVCacheFull(
                f"KV cache full: the batch needs {need} more pages of {self.page_size} tokens, "
                f"{len(self._free)} are free (pool of {self.num_pages - 1} usable pages)", "kv_tokens"
            )
        ids = []
        for h, n in zip(prefixes, new_tokens):
            if h is None:
                sid, seq = self._next_id, _Sequence(0)
                self._next_id += 1
                self._seqs[sid] = seq
            else:
                sid, seq = h.seq_id, self._seqs[h.seq_id]
            grow = self.pages_for(seq.num_tokens + n) - len(seq.pages)
            for _ in range(grow):
                seq.pages.append(self._free.pop())
            seq.num_tokens += n
            ids.append(sid)
        return ids

    def rollback(self, seq_ids: list[int], new_tokens: list[int]) -> None:
        for sid, n in reversed(list(zip(seq_ids, new_tokens))):
            self._shrink(sid, n, drop=self._seqs[sid].num_tokens == n)

    def _shrink(self, sid: int, n: int, drop: bool) -> None:
        seq = self._seqs[sid]
        seq.num_tokens -= n
        keep = self.pages_for(seq.num_tokens)
        while len(seq.pages) > keep:
            self._free.append(seq.pages.pop())
        if drop:
            del self._seqs[sid]

    def release(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        while seq.pages:
            self._free.append(seq.pages.pop())

    def snapshot(self) -> tuple:
        return (tuple(self._free), tuple((k, v.num_tokens, tuple(v.pages)) for k, v in sorted(self._seqs.items())))


class ReferenceShardedAllocator(ReferenceAllocator):
    """The old ShardedKVCache's ledger over the old allocator: per request the chunks
    and each rank's share, per rank the pages used."""

    def __init__(self, num_pages: int, page_size: int, width: int, cache_id: str, cp_size: int, rank: int) -> None:
        super().__init__(num_pages, page_size, width, cache_id)
        self.cp_size, self.rank = cp_size, rank
        self._shares: dict[int, tuple[np.ndarray, list]] = {}
        self._used = np.zeros(cp_size, dtype=np.int64)

    def _request_tokens(self, seq_id: int) -> int:
        return int(self._shares[seq_id][0].sum())

    def _pages(self, t: np.ndarray) -> np.ndarray:
        return -(-t // self.page_size)

    def extend(self, prefixes, new_tokens: list[int]) -> list[int]:
        counts = rank_token_counts(self.cp_size, np.asarray(new_tokens, dtype=np.int64))
        held = np.zeros_like(counts)
        for i, h in enumerate(prefixes):
            if h is not None:
                self.check_handle(h)
                held[:, i] = self._shares[h.seq_id][0]
        after = self._pages(held + counts)
        if (after > self.width).any():
            raise KVCacheFull("width")
        need = after.sum(axis=1) - self._pages(held).sum(axis=1)
        if (need > self.num_pages - 1 - self._used).any():
            raise KVCacheFull("room")
        ids = super().extend(prefixes, counts[self.rank].tolist())
        for i, (sid, h) in enumerate(zip(ids, prefixes)):
            tokens, chunks = self._shares.setdefault(sid, (np.zeros(self.cp_size, dtype=np.int64), []))
            chunks.append((0 if h is None else h.num_tokens, int(new_tokens[i])))
            self._shares[sid] = (tokens + counts[:, i], chunks)
        self._used += need
        return ids

    def rollback(self, seq_ids: list[int], new_tokens=None) -> None:
        for sid in reversed(seq_ids):
            tokens, chunks = self._shares[sid]
            _, new = chunks.pop()
            counts = rank_token_counts(self.cp_size, np.array([new], dtype=np.int64))[:, 0]
            before = tokens - counts
            self._used -= self._pages(tokens) - self._pages(before)
            self._shares[sid] = (before, chunks)
            dropped = not chunks
            if dropped:
                del self._shares[sid]
            self._shrink(sid, int(counts[self.rank]), drop=dropped)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        tokens, _ = self._shares.pop(seq_id)
        self._used -= self._pages(tokens)

    def snapshot(self) -> tuple:
        ledger = tuple((k, tuple(c), tuple(t.tolist())) for k, (t, c) in sorted(self._shares.items()))
        return super().snapshot() + (ledger, tuple(self._used.tolist()))
