"""The compiled host path (graphcp/jit.py, issue 30) against plain references: a rank's
plan described by its segments' runs, the inputs one kernel writes from them (token
ids, positions, cache slots, attention metadata) against the per-row numpy they
replaced, at page sizes that are and are not powers of two, with cached prefixes;
and the same host path without numba (the kernels then run as Python, what a GPU
image without numba gets) giving the same results as the compiled one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import kv_cache

from graphcp.cp import InterleaveLayout, ZigzagLayout
from graphcp.dist import CPGroup
from graphcp.kv.page_table import SCRATCH_PAGE
from graphcp.runtime.batch import BatchPreparer, Request
from graphcp.runtime.capture.static_buffers import StaticBuffers

VOCAB = 1000


def _batches(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        num = int(rng.integers(1, 9))
        yield rng.integers(1, 70, num), rng.integers(0, 40, num)


@pytest.mark.parametrize("layout", [ZigzagLayout, InterleaveLayout])
@pytest.mark.parametrize("cp", [1, 3, 4])
def test_segment_runs_describe_every_row(layout, cp):
    """Each segment's rows are consecutive rows of its request: seg_shift plus the local
    index gives every row's global row and position; max_lens are the segments' maxima."""
    for extend, prefix in _batches(cp, 20):
        plan = layout(cp).plan(extend, prefix)
        for r in range(cp):
            rp = plan.rank(r)
            local = np.arange(rp.num_rows)
            seg_of_row = np.repeat(np.arange(rp.num_segments), rp.seg_q_len)
            assert np.array_equal(rp.rows, rp.seg_shift[0][seg_of_row] + local)
            assert np.array_equal(rp.positions, rp.seg_shift[1][seg_of_row] + local)
            assert np.array_equal(rp.positions, plan.token_position[rp.rows])
            q, kv = rp.seg_q_len, rp.seg_kv_len
            assert tuple(rp.max_lens) == (int(q.max(initial=0)), int(kv.max(initial=0)))
            assert np.array_equal(rp.cu_seqlens_q, np.concatenate([[0], np.cumsum(q)]))


def _preparer(cp: int, rank: int, page_size: int, layout=ZigzagLayout) -> BatchPreparer:
    kv = kv_cache("replicated", 1, 4000, page_size, 1, 2, max_pages_per_seq=-(-1024 // page_size))
    return BatchPreparer(layout(cp), kv, CPGroup(rank=rank, size=cp), VOCAB, max_context=1024,
                         device=torch.device("cpu"), check_consistency=False)


@pytest.mark.parametrize("layout", [ZigzagLayout, InterleaveLayout])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 1), (4, 2)])
def test_rank_inputs_match_the_per_row_reference(layout, page_size, cp, rank):
    """The kernel's ids, positions, slots and metadata equal the per-row numpy path:
    ``flat[rows]``, the plan's positions, ``kv.slots`` and ``kv.page_table_rows`` of each
    segment's request; chunks continue cached prefixes (pages reused and grown)."""
    prep_of = _preparer(cp, rank, page_size, layout)
    kv = prep_of.kv
    rng = np.random.default_rng(page_size * 10 + cp)
    handles: list = []
    for _ in range(12):
        num = int(rng.integers(1, 6))
        prefixes = [handles.pop(int(rng.integers(len(handles)))) if handles and rng.random() < 0.5 else None
                    for _ in range(num)]
        batch = [Request(rng.integers(0, VOCAB, int(rng.integers(1, 60))), h) for h in prefixes]
        prep = prep_of.prepare(batch)
        rp = prep.plan.rank(rank)
        flat = np.concatenate([np.asarray(r.tokens) for r in batch])
        rows = kv.table_rows(prep.seq_ids)
        assert np.array_equal(prep.ids, flat[rp.rows])
        assert np.array_equal(prep.positions, rp.positions)
        assert np.array_equal(prep.slots, kv.slots(rows, rp.positions, rp.seg_request, rp.seg_q_len))
        meta = prep.meta
        assert np.array_equal(meta.cu_seqlens_q_host, rp.cu_seqlens_q)
        assert np.array_equal(meta.kv_lens_host, rp.seg_kv_len)
        width = max(1, kv.pages_for(int(rp.seg_kv_len.max(initial=0))))
        assert meta.page_table_host.shape == (rp.num_segments, width)
        assert np.array_equal(meta.page_table_host, kv.page_table_rows(rows, width)[rp.seg_request])
        assert (meta.max_q_len, meta.max_kv_len) == tuple(rp.max_lens)
        out = [kv.handle(s) for s in prep.seq_ids]
        if rng.random() < 0.25:  # a failed forward: its pages and new sequences go back
            prep_of.abort(prep)
            handles += [h for h in prefixes if h is not None]
        else:
            handles += out
        handles = handles[-6:]


def _host_path_digest() -> dict:
    """A scripted run of the whole host path (validation, reservation, plan, this rank's
    inputs, fill, the undo of the last and of an older reservation, the per-row arrays
    expanded on demand), as JSON-able lists."""
    prep_of = _preparer(4, 1, 3)
    kv = prep_of.kv
    buffers = StaticBuffers(256, 4, 1, 1, 1, 16, 64, torch.float32, "cpu")
    rng = np.random.default_rng(7)
    out: dict = {}
    first = prep_of.prepare([Request(rng.integers(0, VOCAB, n)) for n in (5, 17, 40)])
    handles = [kv.handle(s) for s in first.seq_ids]
    second = prep_of.prepare([Request(rng.integers(0, VOCAB, 9), handles[1]), Request(rng.integers(0, VOCAB, 2))])
    third = prep_of.prepare([Request(rng.integers(0, VOCAB, 30), handles[2])])
    for name, prep in (("first", first), ("second", second), ("third", third)):
        buffers.fill(64, prep.ids, prep.positions, prep.slots)
        rp = prep.plan.rank(1)
        out[name] = [prep.ids.tolist(), prep.positions.tolist(), prep.slots.tolist(),
                     prep.meta.page_table_host.tolist(), prep.meta.cu_seqlens_q_host.tolist(),
                     prep.meta.kv_lens_host.tolist(), rp.rows.tolist(), buffers.kv_slots[:64].tolist()]
    prep_of.abort(third)  # the last reservation
    kv.rollback(second.seq_ids, second.plan.extend_lens)  # an older one: shrunk row by row
    out["after"] = repr(kv.snapshot())
    return out


def test_without_numba_the_host_path_gives_the_same_results():
    """graphcp imports without numba (a warning says the kernels run as Python) and the
    host path's results are the compiled path's, bit for bit."""
    here = Path(__file__).resolve().parent
    code = (
        "import sys, json, warnings; sys.modules['numba'] = None; sys.path.insert(0, sys.argv[1]);"
        "warnings.simplefilter('error', RuntimeWarning)\n"
        "try:\n    import graphcp.jit\nexcept RuntimeWarning as w:\n    print('warned:', w, file=sys.stderr)\n"
        "warnings.simplefilter('ignore', RuntimeWarning)\n"
        "import graphcp.jit\nassert not graphcp.jit.COMPILED\n"
        "from test_host_kernels import _host_path_digest\nprint(json.dumps(_host_path_digest()))"
    )
    run = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "warned: numba is not installed" in run.stderr
    import graphcp.jit

    assert graphcp.jit.COMPILED
    assert json.loads(run.stdout) == json.loads(json.dumps(_host_path_digest()))


def test_the_scratch_page_pads_page_tables():
    """Columns past a sequence's pages (and past the cache's table width) read the scratch page."""
    prep_of = _preparer(2, 0, 4)
    prep = prep_of.prepare([Request(np.arange(3)), Request(np.arange(200))])
    pt = prep.meta.page_table_host
    pages = [len(prep_of.kv.handle(s).pages) for s in prep.seq_ids]
    for s, j in enumerate(prep.plan.rank(0).seg_request.tolist()):
        assert (pt[s, pages[j]:] == SCRATCH_PAGE).all()


# ---- the vectorised fallbacks of the per-token kernels (what runs without numba) -------------
#: (module, kernel): each has a numpy twin ``<kernel>_np`` that graphcp.jit picks without numba
PER_TOKEN_KERNELS = (("graphcp.runtime.batch", "_checked_least"), ("graphcp.attention.kv_exchange", "_rank_inputs"),
                     ("graphcp.runtime.capture.static_buffers", "_fill_rows"))


def _twins(monkeypatch) -> list:
    """Wrap each per-token kernel so that every call also runs its numpy twin on copies of
    the arguments and records whether both returned and wrote the same; the list fills as
    the host path runs."""
    import importlib

    seen: list = []
    for mod_name, name in PER_TOKEN_KERNELS:
        mod = importlib.import_module(mod_name)
        compiled, twin = getattr(mod, name), getattr(mod, name + "_np")

        def both(*args, _c=compiled, _t=twin, _n=name):
            mine = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
            want = _c(*args)
            got = _t(*mine)
            same = (want is None and got is None) or int(want) == int(got)
            same &= all(np.array_equal(a, b) for a, b in zip(args, mine) if isinstance(a, np.ndarray))
            seen.append((_n, same))
            return want

        monkeypatch.setattr(mod, name, both)
    return seen


def test_numpy_twins_equal_the_compiled_kernels_on_the_host_path(monkeypatch):
    """Every call of the three per-token kernels over scripted batches (prefixes, chunks,
    page sizes that are and are not powers of two, cp 1 and 4, both layouts) returns and
    writes the same with the numpy twin as compiled."""
    import graphcp.jit

    if not graphcp.jit.COMPILED:
        pytest.skip("numba is not installed: the twins are what runs, compared by the digest test")
    seen = _twins(monkeypatch)
    for layout, page_size, cp, rank in ((ZigzagLayout, 3, 4, 1), (InterleaveLayout, 16, 1, 0), (ZigzagLayout, 1, 2, 1)):
        test_rank_inputs_match_the_per_row_reference(layout, page_size, cp, rank)
    _host_path_digest()
    assert {n for n, _ in seen} == {n for _, n in PER_TOKEN_KERNELS}
    assert all(same for _, same in seen), [n for n, same in seen if not same]


def test_checked_least_twin_on_edge_values():
    """Out-of-vocabulary ids (negative ones and uint64 ones past int64, seen unsigned), an
    empty id array, a request past max_tokens, a request with no new token."""
    import graphcp.jit
    import graphcp.runtime.batch as batch

    if not graphcp.jit.COMPILED:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    cases = [(np.array([], np.int64), np.array([], np.int64), np.array([], np.int64)),
             (np.array([5, -1, 3]), np.array([3]), np.array([0])),
             (np.array([2**63 - 1, 4]), np.array([2]), np.array([0])),
             (np.array([1, 2, 3]), np.array([2, 1]), np.array([9, 0])),
             (np.array([1, 2]), np.array([2, 0]), np.array([0, 0]))]
    for _ in range(200):
        r = int(rng.integers(1, 6))
        extend = rng.integers(0, 12, r)
        cases.append((rng.integers(-2, 110, int(extend.sum())), extend, rng.integers(0, 8, r)))
    for flat, extend, prefix in cases:
        args = (flat.astype(np.int64), 100, extend.astype(np.int64), prefix.astype(np.int64), 16)
        assert batch._checked_least(*args) == batch._checked_least_np(*args), args


def _kernel_lines(tokens: int, names: list[str]) -> dict[str, int]:
    """Python lines executed in the functions ``names`` by one rank's preparation, fill
    and undo of one request of ``tokens`` tokens."""
    kv = kv_cache("replicated", 1, 1100, 16, 1, 2, max_pages_per_seq=1024)
    prep_of = BatchPreparer(ZigzagLayout(1), kv, CPGroup(), VOCAB, max_context=16384, device=torch.device("cpu"),
                            check_consistency=False)
    buffers = StaticBuffers(16384, 1, 1, 1, 1, 4, 1024, torch.float32, "cpu")
    counts: dict[str, int] = {}

    def local(frame, event, arg):
        if event == "line":
            counts[frame.f_code.co_name] = counts.get(frame.f_code.co_name, 0) + 1
        return local

    wanted = set(names)
    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_name in wanted else None)
    try:
        prep = prep_of.prepare([Request(np.arange(tokens) % VOCAB)])
        buffers.fill(tokens, prep.ids, prep.positions, prep.slots)
        prep_of.abort(prep)
    finally:
        sys.settrace(None)
    return counts


def test_without_numba_the_per_token_kernels_run_no_python_per_token():
    """Without numba the three per-token kernels are their numpy twins: the Python lines
    they execute for one request of 8192 tokens are those for 512 (one rank's whole
    preparation, fill and undo; the per-token Python loops took 29 ms at 8K tokens)."""
    here = Path(__file__).resolve().parent
    names = sorted({n for _, n in PER_TOKEN_KERNELS} | {n + "_np" for _, n in PER_TOKEN_KERNELS})
    code = (
        "import sys, json, warnings; sys.modules['numba'] = None; sys.path.insert(0, sys.argv[1]);"
        "warnings.simplefilter('ignore', RuntimeWarning)\n"
        "from test_host_kernels import _kernel_lines\n"
        f"print(json.dumps([_kernel_lines(n, {names!r}) for n in (512, 8192)]))"
    )
    run = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    small, large = json.loads(run.stdout)
    assert set(small) == {n + "_np" for _, n in PER_TOKEN_KERNELS}, small  # the twins ran, not the loops
    assert small == large, (small, large)
