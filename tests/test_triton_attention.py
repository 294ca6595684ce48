"""The Triton paged-prefill kernel against the torch reference.

Runs under the Triton interpreter on CPU (``TRITON_INTERPRET=1``, set here
before triton is imported), so shapes stay small: the interpreter executes every
program in Python. With ``TRITON_INTERPRET=0`` and a GPU it runs on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from graphcp.attention.backends.triton import TritonAttention, interpreting  # noqa: E402
from graphcp.attention.base import AttentionSpec  # noqa: E402
from graphcp.attention.reference_cases import (  # noqa: E402
    PLANNERS,
    SegmentPlan,
    build_case,
    compare,
    paged_metadata,
    reference,
    run_on_case,
    sentinel_outputs,
    zigzag_plan,
)

if interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("TRITON_INTERPRET=0 and no GPU", allow_module_level=True)

BLOCK = 16  # small tiles: fast under the interpreter, and many tile/segment boundaries


def check_triton(spec: AttentionSpec, plan: SegmentPlan, dtype, pad_rows: int, with_lse: bool, seed: int,
                 backend: TritonAttention | None = None) -> None:
    """The kernel (small tiles unless given) on ``plan`` with scattered pages, against the reference."""
    case = build_case(plan, spec, dtype, DEVICE, torch.Generator().manual_seed(seed), np.random.default_rng(seed),
                      pad_rows=pad_rows)
    cmp = run_on_case(backend or TritonAttention(spec, block_m=BLOCK, block_n=BLOCK), case, with_lse)
    assert cmp.ok, cmp


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
    plan = PLANNERS[kind](extend, prefix, cp, rank)
    check_triton(AttentionSpec(hq, hkv, d, ps, d**-0.5, layout), plan, dtype, pad_rows=9, with_lse=True, seed=1)


def test_zigzag_has_empty_segments():
    """Requests shorter than 2C give q_len 0 segments; the kernel must skip them."""
    plan = zigzag_plan([37, 3, 20], [0, 5, 19], cp=2, rank=0)
    assert 0 in plan.q_lens


def test_without_lse_float16():
    plan = zigzag_plan([30, 17], [8, 0], cp=2, rank=1)
    check_triton(AttentionSpec(4, 2, 64, 16, 0.1, "NHD"), plan, torch.float16, pad_rows=5, with_lse=False, seed=2)


def test_empty_segments_inside_one_tile():
    """Short segments and empty ones, several per 16-row tile, with a long prefix."""
    plan = SegmentPlan(
        q_lens=[3, 0, 0, 5, 1, 0, 20, 2],
        kv_lens=[3, 4, 0, 40, 41, 7, 60, 2],
        seg_request=[0, 1, 2, 3, 3, 4, 5, 6],
        request_tokens=[3, 4, 1, 41, 7, 60, 2],
    )
    check_triton(AttentionSpec(2, 1, 64, 16, 0.125, "HND"), plan, torch.float32, pad_rows=11, with_lse=True, seed=3)


def test_reads_metadata_from_device_only():
    """Graph-style replay: the same tensors, new contents copied in on the device;
    the host copies still describe the old plan and must not matter."""
    spec = AttentionSpec(2, 1, 64, 16, 0.125, "NHD")
    rng = np.random.default_rng(4)
    old, num_pages = paged_metadata(zigzag_plan([20, 9], [16, 0], 2, 0), 16, DEVICE, width=4, rng=rng, spare_pages=2)
    new, _ = paged_metadata(zigzag_plan([25, 7], [3, 10], 2, 0), 16, DEVICE, width=4, rng=rng, spare_pages=2)
    assert old.page_table.shape == new.page_table.shape and old.num_q_rows != new.num_q_rows
    for t_old, t_new in ((old.cu_seqlens_q, new.cu_seqlens_q), (old.kv_lens, new.kv_lens), (old.page_table, new.page_table)):
        t_old.copy_(t_new)
    g = torch.Generator().manual_seed(5)
    rows = 24  # static capacity of the "bucket"
    q = torch.randn(rows, 2, 64, generator=g).to(DEVICE)
    kv = torch.randn(num_pages + 8, 2, 16, 1, 64, generator=g).to(DEVICE)
    out, lse = sentinel_outputs(q)
    TritonAttention(spec, block_m=BLOCK, block_n=BLOCK).forward(q, kv, old, out, lse)
    cmp = compare(out, lse, *reference(spec, q, kv, new), torch.float32)
    assert cmp.ok, cmp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_tile_settings_match_reference(dtype):
    """The per-head_dim settings the backend picks by itself (GQA group of 4 packed
    per tile, K/V loaded once for the group)."""
    spec = AttentionSpec(8, 2, 64, 16, 0.125, "NHD")
    backend = TritonAttention(spec)
    cfg = backend.config(dtype)
    assert (cfg.block_m, cfg.block_n) == ((128, 64) if dtype == torch.bfloat16 else (32, 32))
    plan = zigzag_plan([150, 9, 40], [30, 0, 70], cp=2, rank=1)
    check_triton(spec, plan, dtype, pad_rows=13, with_lse=True, seed=6, backend=backend)


def test_rejects_bad_shapes():
    spec = AttentionSpec(4, 2, 64, 16, 0.125, "NHD")
    backend = TritonAttention(spec)
    meta, num_pages = paged_metadata(zigzag_plan([8], [0], 1, 0), 16, DEVICE)
    q = torch.zeros(8, 4, 64, device=DEVICE)
    hnd_cache = torch.zeros(num_pages, 2, 2, 16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache must be"):
        backend.forward(q, hnd_cache, meta, torch.empty_like(q))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        TritonAttention(AttentionSpec(4, 2, 96, 16, 0.1))
    with pytest.raises(ValueError, match="block_m=16 lanes cannot hold one row of a GQA group of 32"):
        TritonAttention(AttentionSpec(32, 1, 64, 16, 0.1), block_m=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_kernels_run_under_a_triton_3_6_style_interpreter(dtype, monkeypatch):
    """Triton 3.6's interpreter (the GPU image's) converts a loop bound with
    ``int(handle.data)``, which numpy 2 refuses for its one-element scalars: every kernel
    with a device-read range failed ("only 0-dimensional arrays can be converted to Python
    scalars"). Emulated here on whatever Triton is installed (CI's is newer): the 3.6
    ``__index__`` replaces the installed one, the compatibility patch goes on top (as the
    kernel modules apply it at import), and the paged kernel matches the reference.
    ``TRITON_INTERPRET=1 PYTHONPATH=<triton 3.6> pytest tests/test_triton_attention.py``
    runs the real thing (docs/gpu_check.md)."""
    if not interpreting():
        pytest.skip("an interpreter test")
    from triton.runtime import interpreter

    from graphcp.attention.kernels import interpreter_compat, paged_prefill  # noqa: F401 - patched at import

    installed = interpreter._patch_lang_tensor

    def triton_3_6(tensor, scope, *args, **kwargs):
        installed(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))  # Triton 3.6's

    plan = zigzag_plan([37, 3, 20], [0, 5, 19], cp=2, rank=0)
    spec = AttentionSpec(4, 1, 64, 16, 0.125, "NHD")
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", triton_3_6)
    with pytest.raises(Exception, match="only 0-dimensional arrays"):  # what 3.6 did
        check_triton(spec, plan, dtype, pad_rows=9, with_lse=True, seed=6)
    interpreter_compat.patch()
    check_triton(spec, plan, dtype, pad_rows=9, with_lse=True, seed=6)
