"""The Triton sparse MLA attention of DSA models (graphcp/attention/sparse_mla_triton.py)
against the torch reference (TorchSparseMla): the kernel alone on random paged caches
and selections, then whole forwards of the tiny DSA checkpoint at CP 1 and 2, and a
compile-only register/spill check for sm_90a and sm_100a.

The kernel runs under the Triton interpreter here (tests/conftest.py sets
TRITON_INTERPRET=1): sizes are tiny.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import rel_err

from graphcp.attention.base import AttentionMetadata
from graphcp.attention.dsa_topk import mask_to_positions, select_topk
from graphcp.attention.sparse_mla import SparseMlaSpec, TorchSparseMla
from graphcp.attention.sparse_mla_configs import SparseTileConfig
from graphcp.attention.sparse_mla_triton import TritonSparseMla
from graphcp.mla_cache import MlaKVCache

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
PAGE = 4
#: 20 heads (two head tiles, the second partly masked), a latent of 48 and a rope key of
#: 8 (neither a power of two), index_topk 24
SPEC = SparseMlaSpec(num_heads=20, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, kv_lora_rank=48,
                     index_heads=4, index_head_dim=16, index_topk=24, softmax_scale=0.3, num_indexer_layers=1)
#: (request tokens, (first, last) query positions of each of its segments): a request
#: prefilled whole (dense rows, then sparse ones), a prefix extend within index_topk, a
#: long prefix extend, and one request as zigzag's two blocks (one row group)
REQUESTS = ((40, ((0, 40),)), (10, ((7, 10),)), (70, ((64, 70),)), (32, ((0, 6), (26, 32))))
PADDING_ROWS = 3


def few_selected(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A selection with -1 padding and rows of few tokens: each row keeps the first
    1 + (its best score's digits) % k of its top-k positions (a function of the scores
    only, so both backends select the same)."""
    sel = select_topk(scores, k)
    keep = 1 + (scores.max(-1).values * 1e4).floor().long().remainder(k)
    chosen = torch.zeros(scores.shape, dtype=torch.bool)
    cols = torch.arange(sel.shape[1]).unsqueeze(0)
    chosen.scatter_(1, sel.clamp(min=0), (cols < keep.unsqueeze(1)) & (sel >= 0))
    return mask_to_positions(chosen, sel.shape[1])


def _case(dtype: torch.dtype, seed: int = 0):
    """A random cache (pages handed out in shuffled order) with every request written, the
    metadata of their query segments, q, the indexer inputs and kv_b_proj's weight."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    sp = SPEC
    need = sum(-(-n // PAGE) for n, _ in REQUESTS)
    cache = MlaKVCache(2, need + 5, PAGE, sp.kv_lora_rank, sp.qk_rope_head_dim, sp.index_head_dim, (True, False),
                       dtype)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=g))
    cache.index_pool.copy_(torch.randn(cache.index_pool.shape, generator=g))
    free = rng.permutation(np.arange(1, need + 5))
    width = max(-(-n // PAGE) for n, _ in REQUESTS)
    cu, kv_lens, table = [0], [], []
    for n, segments in REQUESTS:
        pages, free = free[: -(-n // PAGE)], free[-(-n // PAGE):]
        for first, last in segments:
            cu.append(cu[-1] + last - first)
            kv_lens.append(last)
            table.append(np.pad(pages, (0, width - pages.size)))
    meta = AttentionMetadata.from_host(np.array(cu), np.array(kv_lens), np.stack(table), PAGE)
    rows = cu[-1] + PADDING_ROWS
    q = torch.randn(rows, sp.num_heads, sp.qk_head_dim, generator=g).to(dtype)
    index_q = torch.randn(rows, sp.index_heads, sp.index_head_dim, generator=g).to(dtype)
    index_w = torch.randn(rows, sp.index_heads, generator=g)
    kv_b = (torch.randn(sp.num_heads * (sp.qk_nope_head_dim + sp.v_head_dim), sp.kv_lora_rank, generator=g)
            * sp.kv_lora_rank ** -0.5).to(dtype)
    return cache, meta, q, index_q, index_w, kv_b


def _run(backend, cache, meta, q, index_q, index_w, kv_b) -> list[torch.Tensor]:
    """Both layers: layer 0 runs the indexer, layer 1 reuses its selection."""
    backend.prepare(meta)
    outs = []
    for layer, (iq, iw) in enumerate(((index_q, index_w), (None, None))):
        out = torch.full((q.shape[0], SPEC.num_heads, SPEC.v_head_dim), float("nan"), dtype=q.dtype)
        backend.forward(layer, q, iq, iw, kv_b, cache, out)
        outs.append(out)
    return outs


@pytest.mark.parametrize("tile", [None, SparseTileConfig(16, 16, 4, 1)], ids=["default-tile", "16x16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_matches_torch_reference(dtype, tile):
    """Random caches, pages out of order, -1-padded selections with few tokens, dense
    rows, a shared layer, padding rows: the Triton path equals the torch reference
    (float32 on the same inputs)."""
    dt = getattr(torch, dtype)
    case = _case(dt)
    got = _run(TritonSparseMla(SPEC, few_selected, tile), *case)
    ref_backend = TorchSparseMla(SPEC, few_selected)
    cache = case[0]
    cache.pool, cache.index_pool = cache.pool.float(), cache.index_pool.float()
    want = _run(ref_backend, cache, case[1], *(t.float() for t in case[2:]))
    live = case[1].num_q_rows
    for layer, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dt
        err = rel_err(g[:live], w[:live])
        assert err < TOL[dtype], f"layer {layer}: {err:.3g}"
        assert torch.equal(g[live:], torch.zeros_like(g[live:])), "padding rows must be zeros"
    # what the selections held: rows of one token, -1-padded rows, full rows, dense rows
    backend = TritonSparseMla(SPEC, few_selected, tile)
    backend.prepare(case[1])
    q, index_q, index_w = _case(dt)[2:5]
    counts = (backend.selection(0, q.shape[0], index_q, index_w, _case(dt)[0], q.device) >= 0).sum(-1)
    assert counts[live:].eq(0).all() and counts[:live].min() == 1
    assert (counts[:live] < SPEC.index_topk).sum() > 20 and (counts == SPEC.index_topk).sum() >= 2
