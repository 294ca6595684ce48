"""Compile-only check of the Triton kernel for Hopper (sm_90a): the settings
``triton_configs`` picks must not spill registers (no GPU needed: Triton compiles
for a CUDA target anywhere, and ptxas reports registers and spills). Runs in a
subprocess because the rest of the suite imports Triton in interpreter mode."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# located, not imported: importing triton here, before test_triton_attention sets
# TRITON_INTERPRET, would leave triton.language compiled-mode in this process
_TRITON = importlib.util.find_spec("triton")
if _TRITON is None or not (Path(_TRITON.origin).parent / "backends" / "nvidia" / "compiler.py").exists():
    pytest.skip("triton with its NVIDIA backend is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = r"""
import json, sys
import torch
from dataclasses import asdict
from graphcp.attention.kernels.paged_prefill_compile_check import compile_variant
from graphcp.attention.kernels.paged_prefill_configs import TileConfig
reports = [asdict(compile_variant(90, torch.bfloat16, d, 4, lse)) for d in (64, 128) for lse in (True, False)]
# the previous one-size setting (64 x 64 lanes/keys, 4 warps) at head_dim 128: it spilled
old = compile_variant(90, torch.bfloat16, 128, 4, True, TileConfig(64, 64, 4, 2))
print(json.dumps({"reports": reports, "old": asdict(old)}))
"""


def test_bf16_kernel_does_not_spill_on_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    seen = set()
    for r in res["reports"]:
        assert r["arch"] == "sm_90a" and r["dtype"] == "bfloat16"
        assert 0 < r["registers"] <= 255
        assert r["spill_store_bytes"] == r["spill_load_bytes"] == 0, r
        assert r["narrow_strides"] == [], r  # row/head offsets are int64 products (TTIR)
        seen.add((r["head_dim"], r["has_lse"]))
    assert seen == {(64, True), (64, False), (128, True), (128, False)}
    # the check can fail: the old setting spills at head_dim 128
    assert res["old"]["spill_store_bytes"] > 0 and res["old"]["registers"] == 255


DECODE_PROGRAM = r"""
import json
import torch
from dataclasses import asdict
from graphcp.attention.kernels import paged_decode_compile_check as cc
from graphcp.attention.kernels.paged_decode_configs import DecodeTile
reports = [asdict(r) for d in (64, 128) for s in (1, 8) for lse in (True, False)
           for r in cc.compile_variant(90, torch.bfloat16, d, 8, lse, s)]
cc.decode_tile = lambda d, dtype: DecodeTile(64, 4, 2)  # the first setting at head_dim 128: it spilled
old = asdict(cc.compile_variant(90, torch.bfloat16, 128, 8, True, 1)[0])
print(json.dumps({"reports": reports, "old": old}))
"""


def test_bf16_decode_kernel_and_its_merge_do_not_spill_on_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", DECODE_PROGRAM], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    seen = set()
    for r in res["reports"]:
        assert r["arch"] == "sm_90a" and 0 < r["registers"] <= 255
        assert r["spill_store_bytes"] == r["spill_load_bytes"] == 0 and r["narrow_strides"] == [], r
        seen.add((r["kernel"], r["head_dim"], r["splits"], r["has_lse"]))
    assert seen == {("decode", d, s, lse) for d in (64, 128) for s in (1, 8) for lse in (True, False)} | {
        ("merge", d, 8, lse) for d in (64, 128) for lse in (True, False)}
    assert res["old"]["spill_store_bytes"] > 0 and res["old"]["registers"] == 255  # the check can fail


DECODE_VARIANTS = r"""
import json
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from graphcp.attention.kernels import paged_decode as tk

seen = {}
for fn in (tk._paged_decode_kernel, tk._merge_splits_kernel):
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))

    def record(*args, grid, warmup, fn=fn, binder=binder, **kw):  # what a launch would compile for
        _, spec, opts = binder(*args, **kw)
        seen.setdefault(fn.__name__, set()).add(json.dumps([[str(x) for x in spec], opts.get("num_warps")]))

    fn.run = record
hq, hkv, d, ps = 32, 8, 128, 16
k = torch.empty(64, ps, hkv, d, dtype=torch.bfloat16, device="meta")
strides = (k.stride(0), k.stride(1), k.stride(2), k.stride(3))
for rows in (1, 3, 8, 64):
    for width in (1, 2, 5, 16, 17, 100, 128, 513, 2048):
        for lse in (True, False):
            q = torch.empty(rows, hq, d, dtype=torch.bfloat16, device="meta")
            tk.launch(q, k, k, torch.empty_like(q), torch.empty(rows, hq, device="meta") if lse else None,
                      torch.empty(rows, dtype=torch.int32, device="meta"),
                      torch.empty(rows, width, dtype=torch.int32, device="meta"), group=hq // hkv, page_size=ps,
                      scale=0.1, block_n=64, upcast_dot=False, num_warps=8, num_stages=2, k_strides=strides,
                      v_strides=strides)
print(json.dumps({n: len(v) for n, v in seen.items()}))
"""


def test_decode_steps_of_any_batch_and_width_share_six_variants():
    """An eager decode step's page table is as wide as its longest request: were the split
    count a constexpr, every width would compile its own variant on a GPU (30 over these
    steps before). Counted with Triton's argument binder for sm_90; nothing is compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", DECODE_VARIANTS], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"_paged_decode_kernel": 4, "_merge_splits_kernel": 2}


WARMUP_COVERS = r"""
import json
import numpy as np
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from graphcp.attention.kernels import paged_decode as dk, paged_prefill as tk

seen = []
# the prefill kernel and (the check's decode rows warm them too) the decode kernels
for fn in (tk._paged_prefill_kernel, dk._paged_decode_kernel, dk._merge_splits_kernel):
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))

    def record(*args, grid, warmup, fn=fn, binder=binder, **kw):  # what a launch would compile for: none runs
        _, spec, opts = binder(*args, **kw)
        key = json.dumps([fn.__name__, [str(x) for x in spec], opts.get("num_warps"), opts.get("num_stages")])
        if key not in seen:
            seen.append(key)

    fn.run = record
# no kernel runs here (fn.run records), so the refusal of compiled Triton on a CPU (the
# interpreter would change the launches' specialisations) is lifted for this harness
import graphcp.attention.backends.triton as triton_backend
triton_backend.cpu_problem = lambda device: None
from graphcp.cli.main import build_parser
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.kernels import warm_triton
from graphcp.gpucheck.settings import model_heads, settings_from_args
st = settings_from_args(build_parser().parse_args(["gpu-check", "--skip-large"]))
st.device, st.graph_dtypes = "cpu", ("bfloat16",)
budget = Budget(600.0, {"warmup": 600.0}, 0.0)
budget.start("warmup")
warm_triton(st, budget, model_heads(st.models), model_heads(("default",)))
warmed = len(seen)
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.config import RuntimeConfig
from graphcp import PrefillEngine, Request
rng = np.random.default_rng(0)
for graph in ("breakable", "full"):
    eng = PrefillEngine("default", RuntimeConfig(dtype="bfloat16", graph=graph, attention="triton", kv_tokens=2048,
                                                 max_requests=4), None, BucketSet((48, 128), padding_factor=64.0))
    eng.capture()
    for lens in ((100,), (20, 9, 13, 2)):
        for eager in (False, True):
            out = eng.prefill([Request(rng.integers(0, 8000, n)) for n in lens], force_eager=eager)
            for h in out.handles:
                eng.release(h)
print(json.dumps({"warmed": warmed, "total": len(seen)}))
"""


def test_gpu_check_warmup_compiles_every_variant_the_model_launches():
    """The GPU check compiles Triton variants up front: the launches of eager,
    breakable and full-graph forwards (batches of 1 and 4 requests, two buckets)
    must need no other specialisation of the kernel. Counted with Triton's own
    argument binder for an sm_90 target; nothing is compiled or run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", WARMUP_COVERS], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["warmed"] >= 8 and res["total"] == res["warmed"]
