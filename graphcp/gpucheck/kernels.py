"""Attention kernels: Triton warm-up (every variant the run will launch compiled
first, compiles counted, registers and spills read from the compiled kernels)
and every available backend against the torch reference.

Cases come from :mod:`graphcp.attention.reference_cases`, the harness the tests use:
zigzag ranks with cached prefixes and requests shorter than 2C (empty segments),
padded with empty segments to ``SEGMENT_SLOTS`` as a full graph's static
metadata is, over random K/V whose pages are scattered; the reference is
:class:`TorchAttention` in float32 on the same, rounded inputs.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np
import torch

from graphcp.attention.backends.triton import TritonAttention
from graphcp.attention.base import AttentionSpec
from graphcp.attention.reference_cases import (
    SEGMENT_SLOTS,
    TOLERANCE,
    SegmentPlan,
    build_case,
    edge_and_random_batches,
    paged_metadata,
    random_inputs,
    run_on_case,
    sentinel_outputs,
)
from graphcp.attention.registry import AttentionLimits, make_attention, preferred_kv_layout
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import TIME_BUDGET, err, fail, free_device_memory, log, skip, sync
from graphcp.gpucheck.settings import Settings

#: dtypes each backend's kernels take (others are recorded as skipped, not as errors)
BACKEND_DTYPES = {
    "torch": ("float32", "bfloat16"),
    "triton": ("float32", "bfloat16"),
    "flashinfer": ("bfloat16",),
    "trtllm": ("bfloat16",),
}
#: the warm-up's plan: two 20-token requests
WARMUP_PLAN = SegmentPlan([20, 20], [20, 20], [0, 1], [20, 20])


# ---- Triton warm-up -----------------------------------------------------------------------
def triton_compiled_kernels() -> list[Any] | None:
    """The compiled variants of graphcp's Triton kernel so far (None when interpreted or never launched)."""
    tk = sys.modules.get("graphcp.attention.kernels.paged_prefill")  # imported by the first launch: not before
    return None if tk is None else tk.compiled_kernels()


def _kernel_facts(k) -> dict:
    meta = getattr(k, "metadata", None)
    return {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
            "num_warps": getattr(meta, "num_warps", None), "num_stages": getattr(meta, "num_stages", None),
            "shared_bytes": getattr(meta, "shared", None)}


def warm_triton(st: Settings, budget: Budget, timed_heads: list[tuple[int, int, int]],
                graph_heads: list[tuple[int, int, int]]) -> dict:
    """Launch every Triton variant the run uses once, on a tiny plan: the kernel
    check's shapes (with and without LSE, each dtype), each timed model's (no
    LSE, the timing dtype) and the graph check's model (no LSE, its dtypes).
    Compiles happen here, timed and counted, not inside a measured row or a
    graph capture (the kernel specialises on no batch-dependent value, so the
    model's launches reuse these compiles)."""
    device = torch.device(st.device)
    variants = {(d, h, True) for d in st.check_dtypes for h in st.check_heads}
    variants |= {(d, h, False) for d in st.check_dtypes for h in st.check_heads}
    variants |= {(st.timing_dtype, h, False) for h in timed_heads}
    variants |= {(d, h, False) for d in st.graph_dtypes for h in graph_heads}
    res: dict[str, Any] = {"variants": len(variants), "launched": 0, "status": "ok"}
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(st.seed)
    for dtype_name, (hq, hkv, d), lse in sorted(variants):
        if not budget.allows(5.0):
            res["status"] = f"skipped: {TIME_BUDGET}"
            break
        spec = AttentionSpec(hq, hkv, d, st.page_size, d ** -0.5, "NHD")
        meta, num_pages = paged_metadata(WARMUP_PLAN, st.page_size, device, slots=SEGMENT_SLOTS)
        q, cache = random_inputs(spec, WARMUP_PLAN.num_rows + 8, num_pages, getattr(torch, dtype_name), gen, device)
        out, lse_t = sentinel_outputs(q, lse)
        try:
            TritonAttention(spec).forward(q, cache, meta, out, lse_t)
            sync(device)
            res["launched"] += 1
        except Exception as e:  # noqa: BLE001 - recorded; the kernel check will show it again
            res["status"] = f"error: {err(e)}"
            log(f"triton warm-up {dtype_name} {hq}/{hkv}x{d} lse={lse}: ERROR {err(e)}")
            break
    res["seconds"] = round(time.perf_counter() - t0, 2)
    kernels = triton_compiled_kernels()
    res["compiles"] = None if kernels is None else len(kernels)
    res["kernels"] = [] if kernels is None else [_kernel_facts(k) for k in kernels]
    log(f"triton warm-up: {res['launched']}/{res['variants']} variants, "
        f"{res['compiles'] if res['compiles'] is not None else 'interpreted, no'} compiles, {res['seconds']} s")
    return res


# ---- backends against the reference ------------------------------------------------------
def _record(name: str, dtype_name: str, heads: tuple[int, int, int]) -> dict:
    return {"backend": name, "dtype": dtype_name, "num_q_heads": heads[0], "num_kv_heads": heads[1],
            "head_dim": heads[2], "plans": 0, "max_rel_err_out": None, "max_rel_err_out_nolse": None,
            "max_rel_err_lse": None, "padding_untouched": None, "tol": TOLERANCE[getattr(torch, dtype_name)],
            "status": "pending", "error": None}


def _check_backend(name: str, cases: list, spec: AttentionSpec, device: torch.device, dtype: torch.dtype,
                   limits: AttentionLimits, rec: dict) -> None:
    """Backend ``name`` on every case, with and without LSE: max errors, padding, pass/fail into ``rec``."""
    t0 = time.perf_counter()
    errs = {"out": 0.0, "out_nolse": 0.0, "lse": 0.0}
    padding = True
    layout = preferred_kv_layout(name, device)
    batch = cases[0][0]
    try:
        for batch, case in cases:
            backend = make_attention(name, dataclasses.replace(spec, kv_layout=layout), device,
                                     dataclasses.replace(limits, dtype=dtype))
            with_lse, without = run_on_case(backend, case, True), run_on_case(backend, case, False)
            errs = {"out": max(errs["out"], with_lse.out), "out_nolse": max(errs["out_nolse"], without.out),
                    "lse": max(errs["lse"], with_lse.lse)}
            padding &= with_lse.padding_untouched and without.padding_untouched
            rec["plans"] += 1
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        where = f"check {name} {rec['dtype']} heads={spec.num_q_heads}/{spec.num_kv_heads}x{spec.head_dim}"
        fail(rec, where, e, note=f" (plan: {batch.label()})")
        return
    ok = max(errs.values()) <= rec["tol"] and padding
    rec.update(max_rel_err_out=errs["out"], max_rel_err_out_nolse=errs["out_nolse"], max_rel_err_lse=errs["lse"],
               padding_untouched=padding, status="pass" if ok else "fail", seconds=round(time.perf_counter() - t0, 3))
    log(f"check {name} {rec['dtype']} heads={spec.num_q_heads}/{spec.num_kv_heads}x{spec.head_dim}: "
        f"{rec['status']} out {errs['out']:.2e} lse {errs['lse']:.2e} ({rec['seconds']} s)")


def check_backends(st: Settings, budget: Budget, names: list[str]) -> list[dict]:
    """One record per (backend, dtype, head config): max errors over the plans and pass/fail."""
    device = torch.device(st.device)
    rng = np.random.default_rng(st.seed)
    batches = edge_and_random_batches(rng, st.check_random_plans, st.check_max_extend, st.check_max_prefix)
    records: dict[tuple, dict] = {}
    for dtype_name in st.check_dtypes:
        dtype = getattr(torch, dtype_name)
        for heads in st.check_heads:
            for name in names:
                records[(name, dtype_name, heads)] = _record(name, dtype_name, heads)
            if not budget.allows(5.0):
                for name in names:
                    skip(records[(name, dtype_name, heads)], TIME_BUDGET)
                continue
            hq, hkv, d = heads
            spec = AttentionSpec(hq, hkv, d, st.page_size, d ** -0.5, "NHD")
            gen = torch.Generator().manual_seed(st.seed + d)
            try:
                cases = [(b, build_case(b.plan(), spec, dtype, device, gen, rng, slots=SEGMENT_SLOTS))
                         for b in batches]
            except Exception as e:  # noqa: BLE001 - the reference itself failed: every backend is unchecked
                for name in names:
                    records[(name, dtype_name, heads)].update(status="error", error=f"reference: {err(e)}")
                log(f"reference failed ({dtype_name}, heads {heads}): {err(e)}")
                continue
            limits = AttentionLimits(
                max_segments=SEGMENT_SLOTS,
                max_pages=max(2 * c.num_pages + SEGMENT_SLOTS for _, c in cases),
                max_pages_per_segment=max(c.meta.page_table_host.shape[1] for _, c in cases),
                max_q_rows=max(c.q.shape[0] for _, c in cases),
            )
            for name in names:
                rec = records[(name, dtype_name, heads)]
                if dtype_name not in BACKEND_DTYPES.get(name, ("float32", "bfloat16")):
                    skip(rec, f"{name} does not take {dtype_name}")
                elif not budget.allows(3.0):
                    skip(rec, TIME_BUDGET)
                else:
                    _check_backend(name, cases, spec, device, dtype, limits, rec)
            del cases
            free_device_memory(device)
    return list(records.values())
