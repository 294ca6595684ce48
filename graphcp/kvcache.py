"""Paged KV cache: one pool tensor for all layers, a page allocator, and
per-request page tables and slot mappings.

Memory layout
-------------
``pool`` is one tensor ``[num_layers, num_pages, 2, *page]`` where index 0/1 of
the third dimension is K/V and ``page`` is

- ``NHD``: ``[page_size, num_kv_heads, head_dim]`` (FlashInfer's default), or
- ``HND``: ``[num_kv_heads, page_size, head_dim]`` (what trtllm-gen reads).

``pool[layer]`` is the ``[num_pages, 2, *page]`` tensor the attention backends
take. Token position ``p`` of a request lives in page ``pages[p // page_size]``
at offset ``p % page_size``; its *slot* is ``page * page_size + offset``.

Page 0 is the scratch page: it is never handed to a request, so a write aimed at
slot -1 (padding) can be redirected to slot 0 and keep the write's shape static.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from graphcp.attention.base import KVLayout

SCRATCH_PAGE = 0


class KVCacheFull(RuntimeError):
    """Not enough free pages; the pool is unchanged."""


@dataclass(frozen=True)
class KVHandle:
    """A request's cached KV as of one forward: pass it as the prefix of the next chunk."""

    seq_id: int
    num_tokens: int
    pages: tuple[int, ...]


@dataclass
class _Sequence:
    num_tokens: int
    pages: list[int] = field(default_factory=list)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layout: KVLayout = "NHD",
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if layout not in ("NHD", "HND"):
            raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.layout = num_kv_heads, head_dim, layout
        page = (page_size, num_kv_heads, head_dim) if layout == "NHD" else (num_kv_heads, page_size, head_dim)
        self.pool = torch.zeros((num_layers, num_pages, 2, *page), dtype=dtype, device=device)
        # LIFO free list: recently freed pages are reused first (warm in cache)
        self._free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0

    # ---- capacity -------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold across all requests (scratch page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def layer(self, i: int) -> torch.Tensor:
        return self.pool[i]

    # ---- allocation -----------------------------------------------------------
    def check_handle(self, handle: KVHandle) -> None:
        seq = self._seqs.get(handle.seq_id)
        if seq is None:
            raise KeyError(f"KV handle seq_id={handle.seq_id} is not live (released, or from another cache)")
        if seq.num_tokens != handle.num_tokens:
            raise ValueError(
                f"KV handle seq_id={handle.seq_id} is stale: it holds {handle.num_tokens} tokens, "
                f"the cache now holds {seq.num_tokens} (it was extended since)"
            )

    def extend(self, prefixes: "list[KVHandle | None]", new_tokens: list[int]) -> list[int]:
        """Reserve room for ``new_tokens[i]`` more tokens after ``prefixes[i]`` (a new
        sequence when None), all or nothing. Returns the sequence ids."""
        if len(prefixes) != len(new_tokens):
            raise ValueError("prefixes and new_tokens must have the same length")
        seen: set[int] = set()
        need = 0
        for h, n in zip(prefixes, new_tokens):
            have = 0
            if h is not None:
                self.check_handle(h)
                if h.seq_id in seen:
                    raise ValueError(f"KV handle seq_id={h.seq_id} is the prefix of two requests in one batch")
                seen.add(h.seq_id)
                have = h.num_tokens
            need += self.pages_for(have + n) - self.pages_for(have)
        if need > len(self._free):
            raise KVCacheFull(
                f"KV cache full: the batch needs {need} more pages of {self.page_size} tokens, "
                f"{len(self._free)} are free (pool of {self.num_pages - 1} usable pages)"
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
            if grow:
                taken = self._free[-grow:]  # slices, not a pop per page: batches take thousands
                del self._free[-grow:]
                seq.pages.extend(reversed(taken))
            seq.num_tokens += n
            ids.append(sid)
        return ids

    def rollback(self, seq_ids: list[int], new_tokens: list[int]) -> None:
        """Undo an :meth:`extend` (a forward that failed after reserving). Sequences are
        undone last-first and pages pushed back in reverse pop order, so the free list
        (its order included) is exactly what it was before the extend."""
        for sid, n in reversed(list(zip(seq_ids, new_tokens))):
            seq = self._seqs[sid]
            seq.num_tokens -= n
            keep = self.pages_for(seq.num_tokens)
            if len(seq.pages) > keep:
                self._free.extend(reversed(seq.pages[keep:]))
                del seq.pages[keep:]
            if seq.num_tokens == 0:
                del self._seqs[sid]

    def handle(self, seq_id: int) -> KVHandle:
        seq = self._seqs[seq_id]
        return KVHandle(seq_id, seq.num_tokens, tuple(seq.pages))

    def release(self, handle: KVHandle) -> None:
        seq = self._seqs.pop(handle.seq_id, None)
        if seq is None:
            raise KeyError(f"KV handle seq_id={handle.seq_id} is not live (already released?)")
        self._free.extend(reversed(seq.pages))

    def snapshot(self) -> tuple:
        """Allocator state, for tests that assert a failed call changed nothing."""
        return (tuple(self._free), tuple((k, v.num_tokens, tuple(v.pages)) for k, v in sorted(self._seqs.items())))

    # ---- metadata -------------------------------------------------------------
    def page_table(self, seq_ids: list[int], width: int | None = None) -> np.ndarray:
        """[len(seq_ids), width] int32 page ids, padded with the scratch page."""
        rows = [self._seqs[s].pages for s in seq_ids]
        w = max(max(map(len, rows), default=1), 1) if width is None else width
        table = np.full((len(rows), w), SCRATCH_PAGE, dtype=np.int32)
        for i, r in enumerate(rows):
            if len(r) > w:
                raise ValueError(f"sequence {seq_ids[i]} has {len(r)} pages, page table width is {w}")
            table[i, : len(r)] = r
        return table

    def slots(self, page_table: np.ndarray, row_seq: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each token: ``page_table[row_seq, pos // ps] * ps + pos % ps``."""
        ps = self.page_size
        flat = page_table.ravel().astype(np.int64)
        if ps & (ps - 1) == 0:  # power of two: shifts instead of a division
            shift = ps.bit_length() - 1
            idx = row_seq * page_table.shape[1]
            idx += positions >> shift
            out = flat[idx]
            out <<= shift
            out += positions & (ps - 1)
            return out
        page_idx, offset = np.divmod(positions, ps)
        return flat[row_seq * page_table.shape[1] + page_idx] * ps + offset


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, layout: KVLayout
) -> None:
    """Scatter rows of ``k``/``v`` [n, H, D] into one layer's cache at ``slots`` [n];
    slot -1 (padding) goes to the scratch page so the write keeps a static shape."""
    page_size = kv_cache.shape[2] if layout == "NHD" else kv_cache.shape[3]
    s = slots.clamp(min=0)
    page, off = torch.div(s, page_size, rounding_mode="floor"), s % page_size
    if layout == "NHD":
        kv_cache[page, 0, off] = k
        kv_cache[page, 1, off] = v
    else:
        kv_cache[page, 0, :, off] = k
        kv_cache[page, 1, :, off] = v
