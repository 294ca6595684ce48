"""The allocator's dense page table stays exactly in step with each sequence's page list."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import kv_cache

from graphcp.kv.handle import KVCacheFull
from graphcp.kv.page_table import SCRATCH_PAGE
from graphcp.kv.paged import PagedKVCache


def _cache(num_pages: int, page_size: int = 4, max_pages_per_seq: int | None = None) -> PagedKVCache:
    return kv_cache("replicated", 1, num_pages, page_size, 1, 2, max_pages_per_seq=max_pages_per_seq)


def _old_table(kv: PagedKVCache, seq_ids: list[int], width: int | None = None) -> np.ndarray:
    """The page table as it used to be built: a loop over the page lists."""
    rows = [kv.handle(s).pages for s in seq_ids]
    w = max(max(map(len, rows), default=1), 1) if width is None else width
    table = np.full((len(rows), w), SCRATCH_PAGE, dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table


def _check(kv: PagedKVCache, live: list[int]) -> None:
    pt = kv.page_table(live)
    want = _old_table(kv, live)
    assert pt.dtype == np.int32 and pt.flags.c_contiguous
    np.testing.assert_array_equal(pt, want)
    rows = kv.table_rows(live)
    assert rows.dtype == np.int64 and len(set(rows.tolist())) == len(live)  # one row per live sequence
    np.testing.assert_array_equal(kv.page_table_rows(rows, pt.shape[1]), want)
    w = kv.table_width + 2  # wider than the table: scratch past it
    np.testing.assert_array_equal(kv.page_table_rows(rows, w), _old_table(kv, live, w))
    # the whole table: live rows hold their pages, every other entry is scratch
    full = np.full_like(kv.table, SCRATCH_PAGE)
    for s, r in zip(live, rows.tolist()):
        pages = kv.handle(s).pages
        full[r, : len(pages)] = pages
    np.testing.assert_array_equal(kv.table, full)


def test_random_extend_rollback_release_keep_the_table_in_step():
    rng = random.Random(1234)
    kv = _cache(num_pages=250, page_size=4, max_pages_per_seq=24)
    live: list[int] = []
    max_live = peak = 0  # peak: most sequences live at once, rolled-back ones included
    for _ in range(600):
        op = rng.random()
        if live and (op < 0.15 or kv.num_free_pages < rng.randint(0, 40)):  # release, more often when full
            s = live.pop(rng.randrange(len(live)))
            kv.release(kv.handle(s))
        else:
            k = rng.randint(1, 4)
            ext = [s for s in rng.sample(live, min(len(live), k)) if rng.random() < 0.6]
            prefixes = [kv.handle(s) for s in ext] + [None] * (k - len(ext))
            rng.shuffle(prefixes)
            new = [rng.randint(1, 20) for _ in prefixes]
            before = kv.snapshot()
            try:
                ids = kv.extend(prefixes, new)
            except KVCacheFull:
                assert kv.snapshot() == before
                _check(kv, live)
                continue
            peak = max(peak, len(live) + prefixes.count(None))
            if op < 0.35:  # a forward that failed: undo it
                kv.rollback(ids, new)
                assert kv.snapshot() == before
            else:
                live += [s for s, h in zip(ids, prefixes) if h is None]
        max_live = max(max_live, len(live))
        _check(kv, live)
    assert max_live > 16  # the table grew past its initial rows
    assert kv.table.shape[0] < 2 * peak  # ... by doubling, and only as far as needed: no row leaked
    for s in live:
        kv.release(kv.handle(s))
    free, seqs = kv.snapshot()
    assert sorted(free) == list(range(1, 250)) and seqs == ()
    assert not kv.table.any()


def test_released_and_rolled_back_rows_are_reused():
    kv = _cache(num_pages=64)
    a, b, c = kv.extend([None, None, None], [5, 9, 1])
    rb = kv.table_rows([b])[0]
    kv.release(kv.handle(b))
    d = kv.extend([None], [3])[0]
    assert kv.table_rows([d])[0] == rb  # LIFO: the freed row first
    rows_before = kv.table_rows([a, c, d]).tolist()
    ids = kv.extend([None, None], [2, 2])
    new_rows = kv.table_rows(ids).tolist()
    kv.rollback(ids, [2, 2])
    e, f = kv.extend([None, None], [7, 7])
    assert kv.table_rows([e, f]).tolist() == new_rows  # the rollback gave both rows back, in order
    assert kv.table_rows([a, c, d]).tolist() == rows_before
    _check(kv, [a, c, d, e, f])


def test_growth_keeps_live_rows():
    kv = _cache(num_pages=200, page_size=2)
    ids = kv.extend([None] * 40, [1 + i % 7 for i in range(40)])  # 40 rows: two doublings from 16
    assert kv.table.shape[0] >= 40 and len(set(kv.table_rows(ids).tolist())) == 40
    _check(kv, ids)
    more = kv.extend([kv.handle(s) for s in ids[::3]], [5] * len(ids[::3]))
    assert more == ids[::3]
    _check(kv, ids)


def test_too_long_sequence_raises_and_changes_nothing():
    kv = _cache(num_pages=40, page_size=4, max_pages_per_seq=3)
    assert kv.table_width == 3
    a = kv.extend([None], [10])[0]  # 3 pages: the width
    before, table = kv.snapshot(), kv.table.copy()
    with pytest.raises(KVCacheFull, match=r"request 1 \(sequence 0, 10 \+ 3 tokens\) needs 4 pages .* at most 3"):
        kv.extend([None, kv.handle(a), None], [1, 3, 1])
    with pytest.raises(KVCacheFull, match=r"request 0 \(a new sequence, 0 \+ 13 tokens\) needs 4 pages"):
        kv.extend([None], [13])
    assert kv.snapshot() == before
    np.testing.assert_array_equal(kv.table, table)
    kv.extend([kv.handle(a)], [2])  # still within its last page
    _check(kv, [a])


def test_table_is_read_only_and_page_table_is_a_copy():
    kv = _cache(num_pages=16)
    a = kv.extend([None], [9])[0]
    with pytest.raises(ValueError):
        kv.table[0, 0] = 5
    pt = kv.page_table([a])
    pt[:] = 7
    assert kv.page_table([a]).tolist() == [list(kv.handle(a).pages)]
    assert kv.page_table([]).shape == (0, 1)


def test_width_defaults_and_validation():
    assert _cache(num_pages=9).table_width == 8
    with pytest.raises(ValueError, match="max_pages_per_seq must be >= 1, got 0"):
        _cache(num_pages=9, max_pages_per_seq=0)
