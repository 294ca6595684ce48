"""The Triton sparse MLA attention of DSA models (graphcp/model/dsa/sparse_triton.py)
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
from graphcp.attention.kernels.sparse_latent_configs import SparseTileConfig
from graphcp.kv.layers import HeldLayers
from graphcp.kv.spec import PoolSpec
from graphcp.model.dsa.cache import MlaGeometry, MlaStorage
from graphcp.model.dsa.sparse import SparseMlaSpec, TorchSparseMla
from graphcp.model.dsa.sparse_triton import TritonSparseMla
from graphcp.model.dsa.topk import mask_to_positions, select_topk

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
    pool = PoolSpec(range(2), need + 5, PAGE, dtype)
    cache = MlaStorage(MlaGeometry(sp.kv_lora_rank, sp.qk_rope_head_dim, sp.index_head_dim, (True, False)), pool,
                       HeldLayers(range(2), range(2)))
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


@pytest.mark.parametrize("dtype,tile", [("float32", None), ("bfloat16", None),
                                        ("float32", SparseTileConfig(16, 16, 4, 1))],
                         ids=["float32", "bfloat16", "float32-tile16x16"])
def test_kernel_matches_torch_reference(dtype, tile, monkeypatch):
    """Random caches, pages out of order, -1-padded selections with few tokens, dense
    rows, a shared layer, padding rows: the Triton path equals the torch reference
    (float32 on the same inputs). The kernel gets q_lat row-major [rows, H, kv_lora]:
    bmm's transposed result had a head stride of rows x kv_lora, which passes 2**31
    elements at ~33K rows of DeepSeek V3.2 (128 heads x 512)."""
    dt = getattr(torch, dtype)
    case = _case(dt)
    backend = TritonSparseMla(SPEC, few_selected, tile)
    launch, strides = backend._kernel.launch, []

    def spy(q_lat, *args, **kw):
        strides.append(q_lat.stride())
        return launch(q_lat, *args, **kw)

    monkeypatch.setattr(backend._kernel, "launch", spy)
    got = _run(backend, *case)
    assert strides == [(SPEC.num_heads * SPEC.kv_lora_rank, SPEC.kv_lora_rank, 1)] * 2
    q, index_q, index_w = case[2:5]
    sel = backend.selection(0, q.shape[0], index_q, index_w, case[0], q.device)
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
    counts = (sel >= 0).sum(-1)
    assert counts[live:].eq(0).all() and counts[:live].min() == 1
    assert (counts[:live] < SPEC.index_topk).sum() > 20 and (counts == SPEC.index_topk).sum() >= 2


#: index_topk is 16 in DSA_TINY: requests of 5 (dense) and 40 (sparse) tokens, and a
#: prefix of 20 extended by 12 (its rows sparse, reading cached pages)
E2E_LENS, E2E_PREFIX, E2E_EXT = (5, 40), 20, 12
E2E_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


class _Replay:
    """select_topk that records its selections (the torch run), then hands the same ones
    back in the same order (the triton run): in bfloat16 the two runs' hidden states
    differ by roundings, which flip near-tied top-k choices of later layers (as between
    graphcp and transformers, docs/dsa.md); replayed, the attention itself is compared."""

    def __init__(self):
        self.recorded: list[torch.Tensor] = []
        self.replaying = False
        self.calls = 0

    def __call__(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        if not self.replaying:
            self.recorded.append(select_topk(scores, k))
            return self.recorded[-1]
        sel = self.recorded[self.calls]
        self.calls += 1
        assert sel.shape[0] == scores.shape[0], "the replay must see the recorded blocks"
        return sel


def _e2e_job(group, folder):
    """Logits (rank 0) of a prefix, then its extension batched with fresh requests, for
    each dtype and attention backend (bfloat16: triton replays torch's selections)."""
    from graphcp import PrefillEngine, Request
    from graphcp.config import RuntimeConfig

    rng = np.random.default_rng(19)
    toks = [rng.integers(0, 512, n) for n in E2E_LENS]
    prefix, ext = rng.integers(0, 512, E2E_PREFIX), rng.integers(0, 512, E2E_EXT)
    out = {}
    for dtype in ("float32", "bfloat16"):
        replay = _Replay()
        for attention in ("torch", "triton"):
            eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, attention=attention, kv_tokens=256, moe="tp"),
                                group)
            assert eng.parts.body.attention.name == attention
            if dtype == "bfloat16":
                eng.parts.body.attention.selector = replay
                replay.replaying = attention == "triton"
            h = eng.prefill([Request(prefix)]).handles[0]
            o = eng.prefill([Request(ext, h)] + [Request(t) for t in toks], all_logits=True)
            out[dtype, attention] = (o.logits if group.rank == 0 else None, dict(o.info.stats))
        assert dtype == "float32" or replay.calls == len(replay.recorded) > 0
    return out


@pytest.mark.parametrize("cp", [1, 2])
def test_engine_triton_equals_torch(cp, hf_model_dir):
    """PrefillEngine on the tiny DeepSeek V3.2 checkpoint: attention='triton' gives the
    logits of attention='torch' (dense and sparse requests, a prefix extend), and the
    same indexer work."""
    from graphcp.dist import CPGroup, launch

    folder = hf_model_dir("deepseek_v32")
    per_rank = [_e2e_job(CPGroup(), folder)] if cp == 1 else launch(_e2e_job, cp, folder)
    res = per_rank[0]
    for dtype, tol in E2E_TOL.items():
        (want, want_stats), (got, got_stats) = res[dtype, "torch"], res[dtype, "triton"]
        assert got_stats == want_stats and want_stats["indexer_scored_pairs"] > 0, dtype
        for j, (g, w) in enumerate(zip(got, want)):
            assert rel_err(g, w) < tol, f"{dtype} CP {cp}, request {j}: {rel_err(g, w):.3g}"


def test_bad_settings_and_inputs_name_what_is_wrong():
    from graphcp.errors import ConfigError, InputError

    with pytest.raises(ConfigError, match="block_h and block_n must be powers of two >= 16"):
        TritonSparseMla(SPEC, tile=SparseTileConfig(8, 16, 4, 1))
    cache, meta, q, index_q, index_w, kv_b = _case(torch.float32)
    backend = TritonSparseMla(SPEC)
    backend.prepare(meta)
    out = torch.empty(q.shape[0], SPEC.num_heads, SPEC.v_head_dim)
    with pytest.raises(InputError, match=r"q must be \[rows, 20, 24\]"):
        backend.forward(0, q[:, :4], index_q, index_w, kv_b, cache, out)
    with pytest.raises(InputError, match="the latent cache must be torch.bfloat16"):
        backend.forward(0, q.bfloat16(), index_q, index_w, kv_b, cache, out)
    with pytest.raises(InputError, match=r"out must be \[" + str(q.shape[0])):
        backend.forward(0, q, index_q, index_w, kv_b, cache, out[:, :, :8])


#: the kernel on a q_lat whose head stride times the head index passes 2**31 elements
#: (2**30 + 16 elements a head, 3 heads; the tensor is mostly untouched virtual memory:
#: 4 GiB in bfloat16, 8 GiB in float32, ~0.3 GB resident), against the same q_lat made
#: contiguous and the float32 attention of its row
WRAP = r"""
import json, sys
import torch
from graphcp.attention.kernels import sparse_latent as sk

def case(dtype):
    heads, lora, rope, page, k = 3, 16, 8, 4, 8
    S = 2**30 + 16  # head stride: head 2's offset 2**31 + 32 passes int32
    big = torch.empty(2 * S + lora, dtype=dtype)  # virtual: only the three head rows are touched
    q_lat = big.as_strided((1, heads, lora), (heads * lora, S, 1))
    g = torch.Generator().manual_seed(0)
    q_lat.copy_(torch.randn(1, heads, lora, generator=g).to(dtype))
    q_rope = torch.randn(1, heads, rope, generator=g).to(dtype)
    cache = torch.randn(4, page, lora + rope, generator=g).to(dtype)
    page_table = torch.tensor([[2, 1, 3]], dtype=torch.int32)
    selected = torch.tensor([[0, 2, 3, 5, 7, 8, 10, 11]], dtype=torch.int32)
    counts = torch.tensor([k], dtype=torch.int32)
    row_table = torch.zeros(1, dtype=torch.int32)
    outs = []
    for q in (q_lat, q_lat.contiguous()):
        out = torch.zeros(1, heads, lora, dtype=dtype)
        sk.launch(q, q_rope, cache, out, selected, counts, row_table, page_table, page_size=page, scale=0.25,
                  block_h=16, block_n=16, upcast_dot=dtype != torch.float32, num_warps=4, num_stages=1)
        outs.append(out)
    pos = selected[0].long()
    tok = cache[page_table[0].long()[pos // page], pos % page].float()
    s = (q_lat[0].float() @ tok[:, :lora].T + q_rope[0].float() @ tok[:, lora:].T) * 0.25
    want = torch.softmax(s, -1) @ tok[:, :lora]
    err = float((outs[0][0].float() - want).norm() / want.norm())
    return {"strided_equals_contiguous": bool(torch.equal(outs[0], outs[1])), "rel_err": err}

print(json.dumps({d: case(getattr(torch, d)) for d in sys.argv[1:]}))
"""


def test_head_offsets_past_int32_read_the_right_rows():
    """Under the interpreter (which multiplies i32 by i32 in numpy int32, as the GPU does)
    a head offset of 2**31 + 32 elements must not wrap: the old kernel read 8 GiB below
    q_lat (a segmentation fault, here in a subprocess), the fixed one gives the contiguous
    launch's output bit for bit and the reference within the dtype's tolerance."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", WRAP, "float32", "bfloat16"], capture_output=True, text=True,
                          timeout=300, cwd=root, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for dtype, r in res.items():
        assert r["strided_equals_contiguous"] and r["rel_err"] < TOL[dtype], (dtype, r)


COMPILE = r"""
import json, torch
from dataclasses import asdict
from graphcp.attention.kernels.sparse_latent_compile_check import compile_sparse_variant
from graphcp.attention.kernels.sparse_latent_configs import SparseTileConfig
reports = [asdict(compile_sparse_variant(arch, dt, 512, 64)) for arch in (90, 100)
           for dt in (torch.bfloat16, torch.float32)]
# FlashMLA's 64 heads a program, in this kernel: it spills (the check can fail)
wide = compile_sparse_variant(90, torch.bfloat16, 512, 64, SparseTileConfig(64, 32, 8, 1))
print(json.dumps({"reports": reports, "wide": asdict(wide)}))
"""


def test_kernel_compiles_without_spills_for_sm90a_and_sm100a():
    """Compile-only (no GPU): DeepSeek V3.2 / GLM-5's latent (512 + 64 rope) with the
    settings sparse_tile_config picks, bfloat16 and float32, on sm_90a and sm_100a, has no
    register spills, and its TTIR widens every row and head stride to int64 before the
    offset products. In a subprocess: this process runs Triton in interpreter mode."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    spec = importlib.util.find_spec("triton")
    if spec is None or not (Path(spec.origin).parent / "backends" / "nvidia" / "compiler.py").exists():
        pytest.skip("triton with its NVIDIA backend is not installed")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=300, cwd=root,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["arch"], r["dtype"]) for r in res["reports"]} == {
        (a, d) for a in ("sm_90a", "sm_100a") for d in ("bfloat16", "float32")}
    for r in res["reports"]:
        assert 0 < r["registers"] <= 255 and r["spill_store_bytes"] == r["spill_load_bytes"] == 0, r
        # every row and head offset is an int64 product: q_lat's head stride passes 2**31
        # elements at ~33K rows of DeepSeek V3.2 (128 heads x 512) if anything makes it rows x 512
        assert r["narrow_strides"] == [], r
    assert res["wide"]["spill_store_bytes"] > 0, res["wide"]


def test_breakable_graphs_run_the_kernel_in_the_attention_break(hf_model_dir):
    """graph='breakable' with attention='triton' (the kernel in the break, on the bucket's
    static rows, padding rows included; the capture self-check on): the graph path gives
    the eager torch reference's logits (float32)."""
    from graphcp import PrefillEngine, Request
    from graphcp.config import RuntimeConfig
    from graphcp.runtime.capture.buckets import BucketSet

    folder = hf_model_dir("deepseek_v32")
    rng = np.random.default_rng(19)
    toks = [rng.integers(0, 512, n) for n in E2E_LENS]
    prefix, ext = rng.integers(0, 512, E2E_PREFIX), rng.integers(0, 512, E2E_EXT)
    logits = {}
    for attention, graph in (("torch", "off"), ("triton", "breakable")):
        eng = PrefillEngine(folder, RuntimeConfig(attention=attention, graph=graph, kv_tokens=256, moe="tp"), None,
                            BucketSet((64,), padding_factor=64.0))
        h = eng.prefill([Request(prefix)]).handles[0]
        o = eng.prefill([Request(ext, h)] + [Request(t) for t in toks], all_logits=True)
        assert o.info.path == ("graph" if graph == "breakable" else "eager")
        logits[attention] = o.logits
    for j, (g, w) in enumerate(zip(logits["triton"], logits["torch"])):
        assert rel_err(g, w) < E2E_TOL["float32"], f"request {j}: {rel_err(g, w):.3g}"
