"""Compile-only check of the Triton kernel for Hopper (sm_90a): the settings
``triton_configs`` picks must not spill registers (no GPU needed: Triton compiles
for a CUDA target anywhere, and ptxas reports registers and spills). Runs in a
subprocess because the rest of the suite imports Triton in interpreter mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = r"""
import json, sys
import torch
from dataclasses import asdict
from graphcp.attention.triton_compile_check import compile_variant
from graphcp.attention.triton_configs import TileConfig
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
        seen.add((r["head_dim"], r["has_lse"]))
    assert seen == {(64, True), (64, False), (128, True), (128, False)}
    # the check can fail: the old setting spills at head_dim 128
    assert res["old"]["spill_store_bytes"] > 0 and res["old"]["registers"] == 255
