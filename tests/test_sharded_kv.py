"""The token-sharded KV cache's ledger and handles, simulated for C ranks in one
process (every rank runs the same calls, as SPMD ranks do), and the ring plan's
per-step metadata against a brute-force count over positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import kv_cache

from graphcp.attention.ring.plan import RingPlanError, plan_sharded, visible_keys, visible_keys_of, visible_keys_to
from graphcp.cp import ZigzagLayout
from graphcp.kv.handle import KVCacheFull, KVHandleError
from graphcp.kv.paged import PagedKVCache

PAGE = 4


def _ranks(cp: int, pages: int = 40) -> list[PagedKVCache]:
    return [kv_cache("sharded", 1, pages, PAGE, 1, 2, cp_size=cp, rank=r) for r in range(cp)]


def _extend(caches, prefixes_per_rank, lens):
    return [c.extend(p, lens) for c, p in zip(caches, prefixes_per_rank)]


def _check_holdings(caches, handles):
    """Every rank's positions partition the request; the ledger matches every allocator."""
    cp = len(caches)
    for per_rank in handles:
        h0 = per_rank[0]
        held = [h.positions(r) for r, h in enumerate(per_rank)]
        assert all(h.num_tokens == h0.num_tokens and h.holding.chunks == h0.holding.chunks for h in per_rank)
        assert [len(p) for p in held] == list(h0.holding.rank_tokens)
        assert all(np.all(np.diff(p) > 0) for p in held)  # local order is increasing
        assert np.array_equal(np.sort(np.concatenate(held)), np.arange(h0.num_tokens))
        for r, h in enumerate(per_rank):
            assert len(h.pages) == -(-h.local_tokens(r) // PAGE)
    used = caches[0].placement.rank_used_pages()
    assert all(np.array_equal(c.placement.rank_used_pages(), used) for c in caches)
    assert [c.stored_pages() for c in caches] == used.tolist()
    assert len({c.num_free_pages for c in caches}) == 1  # what a batch can count on, the same everywhere
    assert sum(c.stored_tokens() for c in caches) == sum(h[0].num_tokens for h in handles)
    assert cp == caches[0].cp_size


@pytest.mark.parametrize("cp", [2, 4])
def test_chunks_spread_over_ranks_and_the_ledger_agrees(cp):
    caches = _ranks(cp)
    ids = _extend(caches, [[None, None, None]] * cp, [37, 1, 2 * cp - 1])
    first = [[c.handle(i[j]) for c, i in zip(caches, ids)] for j in range(3)]
    _check_holdings(caches, first)
    # a second chunk of requests 0 and 1 (prefixes sharded already), a fresh one
    ids2 = _extend(caches, [[first[0][r], first[1][r], None] for r in range(cp)], [5, 9, 1])
    second = [[c.handle(i[j]) for c, i in zip(caches, ids2)] for j in range(3)]
    _check_holdings(caches, second + [first[2]])
    assert second[0][0].holding.chunks == ((0, 37), (37, 5)) and second[0][0].num_tokens == 42
    # the first chunk's handles are stale now, on every rank
    with pytest.raises(KVHandleError, match="stale"):
        caches[1].check_handle(first[0][1])
    before = [c.snapshot() for c in caches]
    ids3 = _extend(caches, [[second[0][r]] for r in range(cp)], [11])
    for c, i in zip(caches, ids3):
        c.rollback(i, [11])
    assert [c.snapshot() for c in caches] == before  # pages, rows, ledger: as they were
    for r, c in enumerate(caches):
        for h in (second[0][r], second[1][r], second[2][r], first[2][r]):
            c.release(h)
        assert c.stored_tokens() == 0 and c.num_free_pages == 39 and c.snapshot()[1] == ()


def test_a_rollback_keeps_a_sequence_this_rank_held_nothing_of():
    """A 1-token request leaves rank 1 nothing; undoing its next chunk must not drop it there."""
    caches = _ranks(2)
    ids = _extend(caches, [[None]] * 2, [1])
    hs = [c.handle(i[0]) for c, i in zip(caches, ids)]
    assert hs[1].local_tokens(1) == 0 and hs[1].pages == ()
    ids2 = _extend(caches, [[h] for h in hs], [1])  # again 1 token: rank 1 gets none
    for c, i in zip(caches, ids2):
        c.rollback(i, [1])
    for c, h in zip(caches, hs):
        c.check_handle(h)  # still live everywhere
        c.release(h)


def test_admission_checks_every_rank_and_names_the_short_one():
    caches = _ranks(4, pages=9)  # 8 usable pages of 4 tokens a rank: 32 tokens
    msgs = set()
    for c in caches:
        before = c.snapshot()
        with pytest.raises(KVCacheFull) as e:
            c.extend([None, None], [60, 70])  # 15 + 18 tokens a rank: 4 + 5 pages
        assert c.snapshot() == before
        msgs.add(str(e.value))
    assert len(msgs) == 1  # every rank refuses alike
    (msg,) = msgs
    assert "on rank 0" in msg and "needs 9 more pages" in msg and "8 are free" in msg
    with pytest.raises(KVCacheFull, match="request 0 needs 10 pages of 4 tokens on rank 0, the page table"):
        caches[0].extend([None], [150])  # one request wider than a rank's page table
    # 3x one rank's pool fits sharded (96 tokens over 4 pools)
    ids = [c.extend([None], [96]) for c in caches]
    assert [c.stored_tokens() for c in caches] == [24, 24, 24, 24]
    assert caches[0].capacity_tokens == 4 * 32 and caches[0].placement.rank_capacity_tokens == 32
    assert ids[0] == ids[3]


def _brute_visible(plan, held_positions, q_rank, k_rank):
    """Keys of rank k (its positions) each of rank q's query blocks sees, by position."""
    start, length = plan.blocks()
    out = np.zeros((plan.num_requests, 2), dtype=np.int64)
    for j in range(plan.num_requests):
        keys = held_positions[k_rank][j]
        for e in (0, 1):
            n = length[q_rank, j, e]
            if n:
                rows = start[q_rank, j, e] + np.arange(n)
                counts = np.searchsorted(keys, rows, side="right")
                if q_rank != k_rank:
                    assert len(set(counts.tolist())) == 1  # constant over a block: one non-causal kv_len
                out[j, e] = counts[-1]
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_metadata_matches_a_count_over_positions(cp):
    caches = _ranks(cp, pages=200)
    prefix_ids = _extend(caches, [[None, None]] * cp, [23, 2])
    prefixes = [[c.handle(i[j]) for j in range(2)] for c, i in zip(caches, prefix_ids)]
    lens = [50, 1, 2 * cp - 1]
    ids = _extend(caches, [[prefixes[r][0], prefixes[r][1], None] for r in range(cp)], lens)
    plan = ZigzagLayout(cp).plan(lens, [23, 2, 0])
    held = [[c.handle(s).positions(r) for s in ids[r]] for r, c in enumerate(caches)]
    for r, c in enumerate(caches):
        for exchange in ("pass-kv", "pass-q"):
            sh = plan_sharded(plan, c, ids[r], r, exchange, torch.device("cpu"))
            assert sh.meta is sh.ring.steps[0] and sh.meta.causal
            assert np.array_equal(sh.meta.kv_lens_host.reshape(-1, 2), _brute_visible(plan, held, r, r))
            for i in range(1, cp):
                src = (r - i) % cp
                step = sh.ring.steps[i]
                assert not step.causal
                q_rank, k_rank = (r, src) if exchange == "pass-kv" else (src, r)
                assert np.array_equal(step.kv_lens_host.reshape(-1, 2), _brute_visible(plan, held, q_rank, k_rank))
            if exchange == "pass-kv":  # the message: this rank's pages of the batch, batch order
                want = [p for s in ids[r] for p in c.handle(s).pages]
                assert sh.ring.send_pages.tolist() == want and sum(sh.ring.msg_pages) == sum(
                    len(caches[k].handle(s).pages) for k in range(cp) for s in ids[k])
        # the new rows' slots: local indices after the cached pieces, in this rank's own pages
        slots = plan_sharded(plan, c, ids[r], r, "pass-kv", torch.device("cpu")).slots
        table = {s: c.handle(s).pages for s in ids[r]}
        rp = plan.rank(r)
        for row, (j, pos) in enumerate(zip(rp.row_request.tolist(), rp.positions.tolist())):
            local = int(np.searchsorted(held[r][j], pos))
            assert held[r][j][local] == pos
            assert slots[row] == table[ids[r][j]][local // PAGE] * PAGE + local % PAGE


def test_a_row_no_step_touches_is_refused_before_any_kernel():
    plan = ZigzagLayout(2).plan([8], [4])
    start, length = plan.blocks()
    held = np.array([[2], [2]])  # the cached prefix: 2 positions on each rank
    visible_keys(start, length, held)  # consistent: fine
    with pytest.raises(RingPlanError, match=r"rank 0.s early block of request 0 .*expected 6"):
        visible_keys(start, length, np.array([[2], [1]]))  # a ledger that lost a cached position
    for rank in (0, 1):  # one rank's own check (what a forward runs) refuses it alike
        with pytest.raises(RingPlanError, match=rf"rank {rank}.s early block of request 0 .*expected"):
            visible_keys_of(rank, start, length, np.array([[2], [1]]))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_one_ranks_visible_keys_are_its_row_of_every_ranks(cp):
    """visible_keys_of and visible_keys_to (a forward's: what this rank's rows see, what
    every rank's rows see of this rank's keys; counted from block indices) against
    visible_keys (every rank's, counted from positions: the definition) on random
    batches: prefixes, requests shorter than 2C."""
    rng = np.random.default_rng(cp)
    for _ in range(20):
        num = int(rng.integers(1, 9))
        ext = rng.integers(1, 6 * cp, num)
        pre = rng.integers(0, 3 * cp, num) * (rng.random(num) < 0.5)
        plan = ZigzagLayout(cp).plan(ext, pre)
        start, length = plan.blocks()
        held = np.stack([np.bincount(rng.integers(0, cp, int(p)), minlength=cp) for p in pre], axis=1)  # [C, R]
        every = visible_keys(start, length, held)
        for rank in range(cp):
            np.testing.assert_array_equal(visible_keys_of(rank, start, length, held), every[rank])
            np.testing.assert_array_equal(visible_keys_to(rank, start, length, held), every[:, rank])


def _random_chunks(cp: int, page: int, seed: int, rounds: int = 4):
    """C simulated ranks through a few random batches (new requests and chunks of earlier
    ones); yields after each batch's reservation: the caches, each rank's ids, the plan."""
    rng = np.random.default_rng(seed)
    caches = [kv_cache("sharded", 1, 600, page, 1, 2, cp_size=cp, rank=r) for r in range(cp)]
    handles: list[list] = []  # per live request: its handle on every rank
    for _ in range(rounds):
        num = int(rng.integers(1, 7))
        lens = rng.integers(1, 6 * cp + 4, num).tolist()
        free = list(rng.permutation(len(handles)))
        prior = [int(free.pop()) if free and rng.random() < 0.5 else None for _ in range(num)]
        ids = [c.extend([None if p is None else handles[p][r] for p in prior], lens) for r, c in enumerate(caches)]
        plan = ZigzagLayout(cp).plan(lens, [0 if p is None else handles[p][0].num_tokens for p in prior])
        yield caches, ids, plan
        used = {p for p in prior if p is not None}
        handles = [h for i, h in enumerate(handles) if i not in used]
        handles += [[c.handle(ids[r][j]) for r, c in enumerate(caches)] for j in range(num)]


def _message_table(pages: np.ndarray, width: int) -> np.ndarray:
    """[R, width]: request j's pages in a message of one rank's ``pages`` [R] of every
    request in batch order, after the scratch page 0; scratch past them."""
    first = 1 + np.cumsum(pages) - pages
    col = np.arange(width)
    return np.where(col < pages[:, None], first[:, None] + col, 0)


@pytest.mark.parametrize("cp,page", [(1, 4), (2, 1), (3, 3), (4, 16), (8, 4), (8, 3)])
def test_the_compiled_ring_plan_is_the_reference_counts(cp, page):
    """plan_sharded (compiled) against visible_keys (every rank's counts from positions)
    and the handles (each rank's pages): every step's cu_seqlens_q, kv_lens, page table
    and maxima, the slots, the pass-KV message, on random chunked batches."""
    for caches, ids, plan in _random_chunks(cp, page, seed=cp * 10 + page):
        start, length = plan.blocks()
        after = caches[0].placement.rank_tokens(ids[0])  # [C, R] (every rank's ledger the same)
        every = visible_keys(start, length, after - length.sum(axis=2))
        pages = -(-after // page)
        for r, c in enumerate(caches):
            own = [c.handle(s).pages for s in ids[r]]
            for exchange in ("pass-kv", "pass-q"):
                sh = plan_sharded(plan, c, ids[r], r, exchange, torch.device("cpu"))
                steps = sh.ring.steps
                assert len(steps) == cp and steps[0] is sh.meta and sh.meta.causal
                width = max(1, max(map(len, own)))
                table = np.array([list(p) + [0] * (width - len(p)) for p in own for _ in (0, 1)], dtype=np.int32)
                np.testing.assert_array_equal(sh.seg_page_table, table)
                for i, step in enumerate(steps):
                    src = (r - i) % cp
                    q, k = (src, r) if exchange == "pass-q" else (r, src)
                    q_lens, kv_lens = length[q].reshape(-1), every[q, k].reshape(-1)
                    assert step.causal == (i == 0) and step.page_size == page
                    np.testing.assert_array_equal(step.cu_seqlens_q_host, np.concatenate([[0], np.cumsum(q_lens)]))
                    np.testing.assert_array_equal(step.kv_lens_host, kv_lens)
                    assert (step.max_q_len, step.max_kv_len) == (int(q_lens.max()), int(kv_lens.max()))
                    if i and exchange == "pass-kv":
                        want = _message_table(pages[src], max(1, int(np.delete(pages, r, axis=0).max(initial=0))))
                        np.testing.assert_array_equal(step.page_table_host, want.repeat(2, axis=0))
                    else:
                        np.testing.assert_array_equal(step.page_table_host, table)
                    packed = np.concatenate([step.cu_seqlens_q_host, step.kv_lens_host,
                                             step.page_table_host.reshape(-1)])
                    np.testing.assert_array_equal(step._packed, packed)  # what the device upload reads
                assert sh.ring.rows == plan.local_rows
                if exchange == "pass-kv":
                    assert sh.ring.send_pages.tolist() == [p for ps in own for p in ps]
                    assert sh.ring.msg_pages == pages.sum(axis=1).tolist()
                else:
                    assert sh.ring.send_pages.size == 0 and sh.ring.msg_pages == [0] * cp
            # the new rows' slots: local indices after each request's cached pieces, early block first
            local = np.concatenate([np.arange(a - n, a) for a, n in zip(after[r], length[r].sum(axis=1))])
            req = np.repeat(np.arange(len(own)), length[r].sum(axis=1))
            want = [own[j][x // page] * page + x % page for j, x in zip(req.tolist(), local.tolist())]
            assert sh.slots.tolist() == want


@pytest.mark.parametrize("cp", [2, 4])
def test_a_ledger_that_disagrees_is_refused_as_the_reference_words_it(cp):
    """The compiled history check refuses what visible_keys_of refuses, with its message;
    a ledger that gives a rank fewer positions than this forward's blocks is refused too."""
    for caches, ids, plan in _random_chunks(cp, 4, seed=cp, rounds=3):
        start, length = plan.blocks()
        for r, c in enumerate(caches):
            rows = c.table_rows(ids[r])
            saved = c.placement.ledger.held.copy()
            try:
                for k in range(cp):  # one position of request 0 moved from rank k to the next rank
                    c.placement.ledger.held[:] = saved
                    if c.placement.ledger.held[rows[0], k] == 0:
                        continue
                    c.placement.ledger.held[rows[0], k] -= 1
                    c.placement.ledger.held[rows[0], (k + 1) % cp] += 1
                    before = c.placement.rank_tokens(ids[r], rows) - length.sum(axis=2)
                    try:
                        visible_keys_of(r, start, length, before)
                    except RingPlanError as e:
                        with pytest.raises(RingPlanError) as got:
                            plan_sharded(plan, c, ids[r], r, "pass-kv", torch.device("cpu"))
                        assert str(got.value) == str(e)
                        continue
                    if before[r].min() >= 0:  # the reference admits it: so does the plan
                        plan_sharded(plan, c, ids[r], r, "pass-q", torch.device("cpu"))
                    else:
                        with pytest.raises(RingPlanError, match="ring plan"):
                            plan_sharded(plan, c, ids[r], r, "pass-kv", torch.device("cpu"))
            finally:
                c.placement.ledger.held[:] = saved


def _sharded_digest() -> dict:
    """A scripted run of the sharded host path (reservation, the ring plan of both
    exchanges, pages of 4 and of 3, a refusal, the undo of the last and of an older
    reservation), as JSON-able lists: what the compiled and the interpreted kernels must
    agree on."""
    from graphcp.attention.ring.hardware import HardwareSpec
    from graphcp.attention.ring.plan import RingPlanner
    from graphcp.dist import CPGroup
    from graphcp.runtime.batch import BatchPreparer, Request

    out: dict = {}
    rng = np.random.default_rng(5)
    for page, exchange in ((4, "pass-kv"), (3, "pass-q")):
        kv = kv_cache("sharded", 1, 36, page, 1, 2, cp_size=4, rank=1)  # 35 pages a rank
        prep_of = BatchPreparer(ZigzagLayout(4), kv, CPGroup(rank=1, size=4), 1000, max_context=512,
                                device=torch.device("cpu"), check_consistency=False,
                                planner=RingPlanner(exchange, 1, 1, 1, 4, HardwareSpec()))
        first = prep_of.prepare([Request(rng.integers(0, 1000, n)) for n in (5, 17, 40)])
        handles = [kv.handle(s) for s in first.seq_ids]
        second = prep_of.prepare([Request(rng.integers(0, 1000, 9), handles[1]), Request(rng.integers(0, 1000, 2))])
        third = prep_of.prepare([Request(rng.integers(0, 1000, 30), handles[2])])
        for name, prep in (("first", first), ("second", second), ("third", third)):
            ring = prep.kv_plan
            out[f"{page} {name}"] = [prep.slots.tolist(), ring.send_pages.tolist(), ring.msg_pages, ring.rows] + [
                [s.cu_seqlens_q_host.tolist(), s.kv_lens_host.tolist(), s.page_table_host.tolist(), s.max_q_len,
                 s.max_kv_len] for s in ring.steps]
        before = kv.snapshot()
        with pytest.raises(KVCacheFull) as e:  # 115 or 100 tokens a rank: more pages than are free
            prep_of.prepare([Request(rng.integers(0, 1000, 460 if page == 4 else 400))])
        assert kv.snapshot() == before
        out[f"{page} refused"] = str(e.value)
        prep_of.abort(third)  # the last reservation
        kv.rollback(second.seq_ids)  # an older one: the ledger's chunks
        out[f"{page} after"] = repr(kv.snapshot())
    return out


def test_without_numba_the_sharded_path_gives_the_same_results():
    """The sharded host path's kernels run as Python without numba (graphcp.jit), with
    the compiled path's results, bit for bit."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import graphcp.jit

    here = Path(__file__).resolve().parent
    code = ("import sys, json, warnings; sys.modules['numba'] = None; sys.path.insert(0, sys.argv[1]);"
            "warnings.simplefilter('ignore', RuntimeWarning)\n"
            "import graphcp.jit\nassert not graphcp.jit.COMPILED\n"
            "from test_sharded_kv import _sharded_digest\nprint(json.dumps(_sharded_digest()))")
    run = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert graphcp.jit.COMPILED
    assert json.loads(run.stdout) == json.loads(json.dumps(_sharded_digest()))
