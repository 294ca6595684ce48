"""The batch-at-once KV reservation (issue 30) against the per-request allocator it
replaced (tests/kv_reference.py), run side by side on random workloads: extends of
new and cached sequences, refusals (too wide, too few pages, bad handles), rollbacks
of the last extend and of older ones, releases. Every observable must agree: the
free list in order, each sequence's tokens and pages, the handles, the sharded
ledger, the refusals (message included for the replicated cache), and a refused
call changes nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import kv_cache
from kv_reference import ReferenceAllocator, ReferenceShardedAllocator

from graphcp.kv.handle import KVCacheFull, KVHandleError
from graphcp.kv.page_table import SCRATCH_PAGE


def _pair(sharded: bool, num_pages: int, page_size: int, width: int, cp: int = 1, rank: int = 0):
    if sharded:
        kv = kv_cache("sharded", 1, num_pages, page_size, 1, 2, max_pages_per_seq=width,
                            cp_size=cp, rank=rank)
        return kv, ReferenceShardedAllocator(num_pages, page_size, width, kv.cache_id, cp, rank)
    kv = kv_cache("replicated", 1, num_pages, page_size, 1, 2, max_pages_per_seq=width)
    return kv, ReferenceAllocator(num_pages, page_size, width, kv.cache_id)


def _same(kv, ref, live: list[int]) -> None:
    live = sorted(set(live))
    assert kv.snapshot() == ref.snapshot()
    for s in live:
        pages = kv.handle(s).pages
        assert list(kv.page_table([s])[0, : len(pages)]) == list(pages)
    # every table cell not holding a live sequence's page is the scratch page
    assert int((kv.table != SCRATCH_PAGE).sum()) == sum(len(kv.handle(s).pages) for s in live)


def _bad_handle(ref, prefixes) -> bool:
    """Whether the reference refuses one of these handles (or a repeated one)."""
    handles = [h for h in prefixes if h is not None]
    if len({h.seq_id for h in handles}) < len(handles):
        return True
    try:
        for h in handles:
            ref.check_handle(h)
    except KVHandleError:
        return True
    return False


def _run(kv, ref, rng: random.Random, steps: int, sharded: bool) -> int:
    live: list[int] = []
    pending: list[tuple[list[int], list[int]]] = []  # extends not yet kept or undone
    refused = 0
    for _ in range(steps):
        op = rng.random()
        if pending and op < 0.3:  # undo an extend: usually the last, sometimes an older one
            k = len(pending) - 1 if rng.random() < 0.6 else rng.randrange(len(pending))
            ids, new = pending.pop(k)
            kv.rollback(ids, new)
            ref.rollback(list(ids), list(new))
            for later in pending:  # an undone extend's new sequences: later extends never used them
                assert not set(later[0]) & {s for s in ids if s not in live}
            _same(kv, ref, live + [s for p in pending for s in p[0]])
            continue
        if pending and op < 0.45:  # keep an extend: its sequences are live now
            ids, _ = pending.pop(0)
            live += [s for s in ids if s not in live]
            continue
        if live and (op < 0.55 or kv.num_free_pages < rng.randint(0, 30)):
            s = live.pop(rng.randrange(len(live)))
            if any(s in p[0] for p in pending):
                live.append(s)
                continue
            kv.release(kv.handle(s))
            ref.release(s)
            _same(kv, ref, live + [s for p in pending for s in p[0]])
            continue
        busy = {s for p in pending for s in p[0]}
        free_live = [s for s in live if s not in busy]
        n = rng.randint(1, 6)
        ext = [s for s in rng.sample(free_live, min(len(free_live), n)) if rng.random() < 0.6]
        prefixes = [kv.handle(s) for s in ext] + [None] * (n - len(ext))
        rng.shuffle(prefixes)
        if prefixes and rng.random() < 0.05:  # a handle given twice, or a stale one
            h = next((p for p in prefixes if p is not None), None)
            if h is not None:
                prefixes.append(h if rng.random() < 0.5 else type(h)(h.seq_id, h.num_tokens + 1, h.pages,
                                                                       h.cache_id, h.holding))
        new = [rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(1, 200)]) for _ in prefixes]
        if rng.random() < 0.5:
            new = np.asarray(new, dtype=np.int64)  # what the preparer passes
        before, table = kv.snapshot(), kv.table.copy()
        errs = []
        for who in (kv, ref):
            try:
                ids = who.extend(prefixes, new if who is kv else list(map(int, new)))
                errs.append(None)
            except (KVCacheFull, KVHandleError) as e:
                errs.append(e)
        a, b = errs
        if type(a) is not type(b):
            # the batch checks every handle before any room (the old code went request by
            # request): a batch both wrong ways is refused for its handle now
            assert isinstance(a, KVHandleError) and isinstance(b, KVCacheFull) and _bad_handle(ref, prefixes)
        if a is not None:
            refused += 1
            if not sharded and isinstance(a, KVCacheFull):
                assert str(a) == str(b)
            assert kv.snapshot() == before  # a refusal changes nothing, the table included
            np.testing.assert_array_equal(kv.table, table)
            continue
        pending.append((ids, list(map(int, new)) if rng.random() < 0.5 else new))
        _same(kv, ref, live + [s for p in pending for s in p[0]])
    return refused


@pytest.mark.parametrize("page_size", [4, 3])  # a power of two (shifts) and not
def test_replicated_matches_the_per_request_allocator(page_size):
    rng = random.Random(30 + page_size)
    kv, ref = _pair(False, num_pages=300, page_size=page_size, width=40)
    refused = _run(kv, ref, rng, 1500, sharded=False)
    assert refused > 20  # the refusals were exercised too
    assert kv.table.shape[0] > 16  # and the table's growth


@pytest.mark.parametrize("cp,rank", [(2, 1), (4, 0), (4, 3)])
def test_sharded_matches_the_per_request_ledger(cp, rank):
    rng = random.Random(100 * cp + rank)
    kv, ref = _pair(True, num_pages=120, page_size=4, width=30, cp=cp, rank=rank)
    refused = _run(kv, ref, rng, 1200, sharded=True)
    assert refused > 10
    for s, r in kv.allocator.table.live().items():  # the handles read the same ledger
        h = kv.handle(s)
        tokens, chunks = ref._shares[s]
        assert h.holding.chunks == tuple(chunks) and h.holding.rank_tokens == tuple(tokens.tolist()) and r >= 0


@pytest.mark.parametrize("cp,rank", [(3, 2), (8, 5)])
def test_sharded_matches_the_per_request_ledger_with_pages_of_3(cp, rank):
    """The sharded reservation's compiled counts divide where a page is not a power of two."""
    rng = random.Random(7 * cp + rank)
    kv, ref = _pair(True, num_pages=120, page_size=3, width=30, cp=cp, rank=rank)
    assert _run(kv, ref, rng, 800, sharded=True) > 10


def test_undoing_the_last_extend_equals_undoing_it_the_long_way():
    """The shortcut for the last extend (nothing changed since) and the general undo
    leave the same state, bit for bit (the table included)."""
    rng = np.random.default_rng(3)
    states = []
    for shortcut in (True, False):
        kv = kv_cache("replicated", 1, 200, 4, 1, 2, max_pages_per_seq=30)
        a = kv.extend([None, None], [9, 30])
        new = rng.integers(1, 30, 5).tolist() if not states else states[0][2]
        ids = kv.extend([kv.handle(a[1]), None, None, kv.handle(a[0]), None], new)
        before = (kv.snapshot(), kv.table.copy())
        if not shortcut:
            kv.allocator.last = None  # as if something had changed since
        kv.rollback(ids, new)
        states.append((kv.snapshot(), kv.table.copy(), new))
        assert kv.snapshot() != before[0]
    assert states[0][0] == states[1][0]
    np.testing.assert_array_equal(states[0][1], states[1][1])


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_a_decode_steps_reservation_equals_the_batch_reservation_of_ones(page_size):
    """``PageAllocator.reserve_next`` (a decode step's: one compiled call that also writes
    each token's position and slot) takes the pages ``reserve`` of ones takes, in the same
    order, writes the slots ``run_slots`` gives, and its undo puts the allocator back; a
    step over the pool or past a row's width is refused with nothing changed; a handle made
    from the previous one (its pages reused) equals one made from scratch."""
    rng = random.Random(page_size)
    fast, slow = (kv_cache("replicated", 1, 40, page_size, 1, 2, max_pages_per_seq=12) for _ in range(2))
    handles = {}
    for kv in (fast, slow):
        handles[id(kv)] = [kv.handle(s) for s in kv.extend([None] * 4, [rng.randrange(1, 5 * page_size)
                                                                        for _ in range(4)])]
        rng.seed(page_size)
    for step in range(3 * page_size + 2):
        hf, hs = handles[id(fast)], handles[id(slow)]
        before = fast.snapshot()
        rows_f, rows_s = fast.prefix_rows(hf), slow.prefix_rows(hs)
        try:
            got = fast.reserve_decode(hf, rows_f)
        except KVCacheFull as e:
            assert fast.snapshot() == before
            with pytest.raises(KVCacheFull) as want:
                slow.allocator.reserve(hs, rows_s, np.ones(len(hs), dtype=np.int64))
            assert str(e) == str(want.value)
            break
        if step % 4 == 3:  # the undo
            fast.rollback_decode(got)
            assert fast.snapshot() == before
            continue
        positions = np.array([h.num_tokens for h in hs])
        _, taken = slow.allocator.reserve(hs, rows_s, np.ones(len(hs), dtype=np.int64))
        assert fast.snapshot() == slow.snapshot() and np.array_equal(got.rows, taken)
        assert np.array_equal(got.positions, positions) and np.array_equal(got.local_lens, positions + 1)
        assert np.array_equal(got.slots, slow.run_slots(taken, positions, np.ones(len(hs), dtype=np.int64)))
        handles[id(fast)] = fast.handles_after(hf)
        handles[id(slow)] = [slow.handle(h.seq_id) for h in hs]
        assert handles[id(fast)] == [fast.handle(h.seq_id) for h in hf]
        assert [(h.seq_id, h.num_tokens, h.pages) for h in handles[id(fast)]] == \
            [(h.seq_id, h.num_tokens, h.pages) for h in handles[id(slow)]]
