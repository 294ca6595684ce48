"""The Triton paged-prefill kernel against the torch reference.

Runs under the Triton interpreter on CPU (``TRITON_INTERPRET=1``, set here
before triton is imported), so shapes stay small: the interpreter executes every
program in Python. With ``TRITON_INTERPRET=0`` and a GPU it runs on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from graphcp.attention.base import AttentionMetadata, AttentionSpec  # noqa: E402
from graphcp.attention.torch_ref import TorchAttention  # noqa: E402
from graphcp.attention.triton_backend import TritonAttention, interpreting  # noqa: E402

if interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("TRITON_INTERPRET=0 and no GPU", allow_module_level=True)

SENTINEL = -1024.0  # exact in every dtype tested
BLOCK = 16  # small tiles: fast under the interpreter, and many tile/segment boundaries
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass
class Plan:
    q_lens: list[int]
    kv_lens: list[int]
    seg_request: list[int]  # request index of each segment
    request_tokens: list[int]  # prefix + extend of each request


def zigzag_plan(extend: list[int], prefix: list[int], cp: int, rank: int) -> Plan:
    """Rank ``rank``'s segments: early block r and late block 2C-1-r of every request."""
    q_lens, kv_lens, seg_req = [], [], []
    for j, (n, p) in enumerate(zip(extend, prefix)):
        base, rem = divmod(n, 2 * cp)
        blocks = [base + (b < rem) for b in range(2 * cp)]
        for b in (rank, 2 * cp - 1 - rank):
            q_lens.append(blocks[b])
            kv_lens.append(p + sum(blocks[: b + 1]))
            seg_req.append(j)
    return Plan(q_lens, kv_lens, seg_req, [p + n for n, p in zip(extend, prefix)])


def interleave_plan(extend: list[int], prefix: list[int], cp: int, rank: int) -> Plan:
    """Rank ``rank`` owns flattened rows rank, rank + C, ...; each is a one-row segment."""
    q_lens, kv_lens, seg_req = [], [], []
    flat = [(j, t) for j, n in enumerate(extend) for t in range(n)]
    for j, t in flat[rank::cp]:
        q_lens.append(1)
        kv_lens.append(prefix[j] + t + 1)
        seg_req.append(j)
    return Plan(q_lens, kv_lens, seg_req, [p + n for n, p in zip(extend, prefix)])


def make_meta(
    plan: Plan, page_size: int, rng: np.random.Generator, width: int | None = None
) -> tuple[AttentionMetadata, int]:
    """Metadata with each request's pages scattered over a shuffled pool; returns
    (metadata, number of pages in the pool). Page 0 stays the scratch page."""
    need = [-(-t // page_size) for t in plan.request_tokens]
    num_pages = sum(need) + 3
    pool = rng.permutation(np.arange(1, num_pages))
    starts = np.concatenate([[0], np.cumsum(need)])
    if width is None:
        width = max(need + [1]) + 1  # one spare column: entries past a request's pages are 0
    table = np.zeros((len(plan.q_lens), width), np.int32)
    for s, j in enumerate(plan.seg_request):
        table[s, : need[j]] = pool[starts[j] : starts[j + 1]]
    cu = np.concatenate([[0], np.cumsum(plan.q_lens)]).astype(np.int32)
    meta = AttentionMetadata.from_host(cu, np.array(plan.kv_lens), table, page_size, DEVICE)
    return meta, num_pages


def run_both(spec: AttentionSpec, meta, num_pages, dtype, pad_rows, with_lse, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = meta.num_q_rows + pad_rows
    page = (
        (spec.page_size, spec.num_kv_heads, spec.head_dim)
        if spec.kv_layout == "NHD"
        else (spec.num_kv_heads, spec.page_size, spec.head_dim)
    )
    q = torch.randn(rows, spec.num_q_heads, spec.head_dim, generator=g).to(dtype).to(DEVICE)
    kv = torch.randn(num_pages, 2, *page, generator=g).to(dtype).to(DEVICE)
    results = []
    for backend in (TorchAttention(spec), TritonAttention(spec, block_m=BLOCK, block_n=BLOCK)):
        out = torch.full_like(q, SENTINEL)
        lse = torch.full((rows, spec.num_q_heads), SENTINEL, device=DEVICE) if with_lse else None
        backend.forward(q, kv, meta, out, lse)
        results.append((out, lse))
    return results


def check(results, meta, dtype, with_lse=True):
    (ref_o, ref_l), (o, l) = results
    n, tol = meta.num_q_rows, TOL[dtype]
    torch.testing.assert_close(o[:n].float(), ref_o[:n].float(), rtol=tol, atol=tol)
    assert (o[n:].float() == SENTINEL).all(), "padding rows of out were written"
    if with_lse:
        torch.testing.assert_close(l[:n], ref_l[:n], rtol=tol, atol=tol)
        assert (l[n:] == SENTINEL).all(), "padding rows of lse were written"


PLANS = {"zigzag": zigzag_plan, "interleave": interleave_plan}
CASES = {
    # id: (layout, dtype, q_heads, kv_heads, head_dim, page_size, layout fn, extend, prefix, cp, rank)
    "zigzag-gqa4": ("NHD", torch.float32, 4, 1, 64, 16, "zigzag", [37, 3, 20], [0, 5, 19], 2, 0),
    "zigzag-gqa2-bf16-hnd": ("HND", torch.bfloat16, 4, 2, 128, 8, "zigzag", [41, 2, 9], [12, 0, 3], 2, 1),
    "interleave-gqa8": ("HND", torch.float32, 8, 1, 64, 16, "interleave", [9, 14, 3], [4, 0, 21], 3, 1),
    "interleave-mha-bf16": ("NHD", torch.bfloat16, 2, 2, 64, 4, "interleave", [7, 11], [0, 6], 2, 0),
    # a group of 3 heads packs into 4 lanes a row (one lane masked off)
    "zigzag-gqa3": ("NHD", torch.float32, 6, 2, 64, 16, "zigzag", [33, 5, 18], [7, 0, 16], 2, 1),
    "zigzag-gqa3-bf16": ("HND", torch.bfloat16, 6, 2, 64, 16, "zigzag", [33, 5, 18], [7, 0, 16], 2, 0),
}


@pytest.mark.parametrize(
    "layout,dtype,hq,hkv,d,ps,kind,extend,prefix,cp,rank", list(CASES.values()), ids=list(CASES)
)
def test_matches_reference(layout, dtype, hq, hkv, d, ps, kind, extend, prefix, cp, rank):
    plan = PLANS[kind](extend, prefix, cp, rank)
    spec = AttentionSpec(hq, hkv, d, ps, d**-0.5, layout)
    meta, num_pages = make_meta(plan, ps, np.random.default_rng(1))
    check(run_both(spec, meta, num_pages, dtype, pad_rows=9, with_lse=True), meta, dtype)


def test_zigzag_has_empty_segments():
    """Requests shorter than 2C give q_len 0 segments; the kernel must skip them."""
    plan = zigzag_plan([37, 3, 20], [0, 5, 19], cp=2, rank=0)
    assert 0 in plan.q_lens


def test_without_lse_float16():
    plan = zigzag_plan([30, 17], [8, 0], cp=2, rank=1)
    spec = AttentionSpec(4, 2, 64, 16, 0.1, "NHD")
    meta, num_pages = make_meta(plan, 16, np.random.default_rng(2))
    check(run_both(spec, meta, num_pages, torch.float16, pad_rows=5, with_lse=False), meta, torch.float16, False)


def test_empty_segments_inside_one_tile():
    """Short segments and empty ones, several per 16-row tile, with a long prefix."""
    plan = Plan(
        q_lens=[3, 0, 0, 5, 1, 0, 20, 2],
        kv_lens=[3, 4, 0, 40, 41, 7, 60, 2],
        seg_request=[0, 1, 2, 3, 3, 4, 5, 6],
        request_tokens=[3, 4, 1, 41, 7, 60, 2],
    )
    spec = AttentionSpec(2, 1, 64, 16, 0.125, "HND")
    meta, num_pages = make_meta(plan, 16, np.random.default_rng(3))
    check(run_both(spec, meta, num_pages, torch.float32, pad_rows=11, with_lse=True), meta, torch.float32)


def test_reads_metadata_from_device_only():
    """Graph-style replay: the same tensors, new contents copied in on the device;
    the host copies still describe the old plan and must not matter."""
    spec = AttentionSpec(2, 1, 64, 16, 0.125, "NHD")
    rng = np.random.default_rng(4)
    old, num_pages = make_meta(zigzag_plan([20, 9], [16, 0], 2, 0), 16, rng, width=4)
    new, _ = make_meta(zigzag_plan([25, 7], [3, 10], 2, 0), 16, rng, width=4)
    assert old.page_table.shape == new.page_table.shape and old.num_q_rows != new.num_q_rows
    for t_old, t_new in ((old.cu_seqlens_q, new.cu_seqlens_q), (old.kv_lens, new.kv_lens), (old.page_table, new.page_table)):
        t_old.copy_(t_new)
    g = torch.Generator().manual_seed(5)
    rows = 24  # static capacity of the "bucket"
    q = torch.randn(rows, 2, 64, generator=g).to(DEVICE)
    kv = torch.randn(num_pages + 8, 2, 16, 1, 64, generator=g).to(DEVICE)
    ref_o, ref_l = torch.full_like(q, SENTINEL), torch.full((rows, 2), SENTINEL, device=DEVICE)
    TorchAttention(spec).forward(q, kv, new, ref_o, ref_l)
    o, lse = torch.full_like(q, SENTINEL), torch.full((rows, 2), SENTINEL, device=DEVICE)
    TritonAttention(spec, block_m=BLOCK, block_n=BLOCK).forward(q, kv, old, o, lse)
    check([(ref_o, ref_l), (o, lse)], new, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_tile_settings_match_reference(dtype):
    """The per-head_dim settings the backend picks by itself (GQA group of 4 packed
    per tile, K/V loaded once for the group)."""
    plan = zigzag_plan([150, 9, 40], [30, 0, 70], cp=2, rank=1)
    spec = AttentionSpec(8, 2, 64, 16, 0.125, "NHD")
    meta, num_pages = make_meta(plan, 16, np.random.default_rng(6))
    g = torch.Generator().manual_seed(7)
    rows = meta.num_q_rows + 13
    q = torch.randn(rows, 8, 64, generator=g).to(dtype).to(DEVICE)
    kv = torch.randn(num_pages, 2, 16, 2, 64, generator=g).to(dtype).to(DEVICE)
    backend = TritonAttention(spec)
    cfg = backend.config(dtype)
    assert (cfg.block_m, cfg.block_n) == ((128, 64) if dtype == torch.bfloat16 else (32, 32))
    results = []
    for b in (TorchAttention(spec), backend):
        out, lse = torch.full_like(q, SENTINEL), torch.full((rows, 8), SENTINEL, device=DEVICE)
        b.forward(q, kv, meta, out, lse)
        results.append((out, lse))
    check(results, meta, dtype)


def test_rejects_bad_shapes():
    spec = AttentionSpec(4, 2, 64, 16, 0.125, "NHD")
    backend = TritonAttention(spec)
    meta, num_pages = make_meta(zigzag_plan([8], [0], 1, 0), 16, np.random.default_rng(0))
    q = torch.zeros(8, 4, 64, device=DEVICE)
    hnd_cache = torch.zeros(num_pages, 2, 2, 16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache must be"):
        backend.forward(q, hnd_cache, meta, torch.empty_like(q))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        TritonAttention(AttentionSpec(4, 2, 96, 16, 0.1))
    with pytest.raises(ValueError, match="block_m=16 lanes cannot hold one row of a GQA group of 32"):
        TritonAttention(AttentionSpec(32, 1, 64, 16, 0.1), block_m=16)
