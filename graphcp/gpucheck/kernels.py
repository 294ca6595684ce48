"""Attention kernels: Triton warm-up (every variant the run will launch compiled
first, compiles counted, registers and spills read from the compiled kernels)
and every available backend against the torch reference.

Cases come from :mod:`graphcp.attention.reference_cases`, the harness the tests use:
zigzag ranks with cached prefixes and requests shorter than 2C (empty segments),
padded with empty segments to ``SEGMENT_SLOTS`` as a full graph's static
metadata is, over random K/V whose pages are scattered; the reference is
:class:`TorchAttention` in float32 on the same, rounded inputs. The non-causal rows
run each backend on decode steps (one query row a request over every key the rank
holds: what an eager decode step gives a backend without a decode kernel of any batch,
``CAUSAL=False`` in Triton's), against the same reference.

The Triton variants (:func:`warm_triton`): the prefill kernel causal and not, with and
without LSE; the decode kernel (graphcp.attention.kernels.paged_decode) with and without
LSE, with one split of the keys and with several (then its merge kernel too).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np
import torch

from graphcp.attention.backends.triton import TritonAttention
from graphcp.attention.backends.triton_decode import TritonDecodeAttention
from graphcp.attention.base import AttentionSpec
from graphcp.attention.reference_cases import (
    SEGMENT_SLOTS,
    TOLERANCE,
    DecodeCase,
    SegmentPlan,
    build_case,
    compare_decode,
    decode_case,
    edge_and_random_batches,
    paged_metadata,
    random_inputs,
    run_decode_case,
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
#: the warm-up's decode step: two requests and a padding row, a table wider than needed
WARMUP_DECODE = ([37, 5, 0], 4, 6)
#: the Triton kernels' variants: (kernel, causal or several splits)
PREFILL_CAUSAL, PREFILL_NONCAUSAL, DECODE_ONE_SPLIT, DECODE_SPLITS = "prefill", "prefill-noncausal", "decode", \
    "decode-splits"
#: the decode kernel's key splits of a forced several-split launch
FORCED_SPLITS = 3


# ---- Triton warm-up -----------------------------------------------------------------------
def triton_compiled_kernels() -> list[Any] | None:
    """The compiled variants of graphcp's Triton kernels so far (None when interpreted or never launched)."""
    got = [m.compiled_kernels() for name in ("paged_prefill", "paged_decode")
           if (m := sys.modules.get(f"graphcp.attention.kernels.{name}")) is not None]  # (imported by a launch)
    return None if not got or any(g is None for g in got) else [k for g in got for k in g]


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
    variants = triton_variants(st, timed_heads, graph_heads)
    kinds = sorted({v[0] for v in variants})
    res: dict[str, Any] = {"variants": len(variants), "launched": 0, "status": "ok",
                           "by_kernel": {k: sum(v[0] == k for v in variants) for k in kinds}}
    t0 = time.perf_counter()
    gen, rng = torch.Generator().manual_seed(st.seed), np.random.default_rng(st.seed)
    for kind, dtype_name, (hq, hkv, d), lse in sorted(variants):
        if not budget.allows(5.0):
            res["status"] = f"skipped: {TIME_BUDGET}"
            break
        spec = AttentionSpec(hq, hkv, d, st.page_size, d ** -0.5, "NHD")
        try:
            _launch_variant(kind, spec, getattr(torch, dtype_name), lse, device, gen, rng)
            sync(device)
            res["launched"] += 1
        except Exception as e:  # noqa: BLE001 - recorded; the kernel check will show it again
            res["status"] = f"error: {err(e)}"
            log(f"triton warm-up {kind} {dtype_name} {hq}/{hkv}x{d} lse={lse}: ERROR {err(e)}")
            break
    res["seconds"] = round(time.perf_counter() - t0, 2)
    kernels = triton_compiled_kernels()
    res["compiles"] = None if kernels is None else len(kernels)
    res["kernels"] = [] if kernels is None else [_kernel_facts(k) for k in kernels]
    log(f"triton warm-up: {res['launched']}/{res['variants']} variants, "
        f"{res['compiles'] if res['compiles'] is not None else 'interpreted, no'} compiles, {res['seconds']} s")
    return res


def triton_variants(st: Settings, timed_heads: list[tuple[int, int, int]],
                    graph_heads: list[tuple[int, int, int]]) -> set[tuple[str, str, tuple[int, int, int], bool]]:
    """(kernel, dtype, heads, with LSE) of every Triton launch the run makes: the kernel
    check's shapes, causal and not, with and without LSE, in each dtype; the decode
    kernel's on the same shapes, one split and several, with and without LSE; each timed
    model's (causal, no LSE, the timing dtype); the graph and engine checks' model (causal
    prefill, decode steps: no LSE at CP 1, either split count)."""
    checked = {(d, h, lse) for d in st.check_dtypes for h in st.check_heads for lse in (True, False)}
    out = {(k, d, h, lse) for k in (PREFILL_CAUSAL, PREFILL_NONCAUSAL, DECODE_ONE_SPLIT, DECODE_SPLITS)
           for d, h, lse in checked}
    out |= {(PREFILL_CAUSAL, st.timing_dtype, h, False) for h in timed_heads}
    out |= {(PREFILL_CAUSAL, d, h, False) for d in st.graph_dtypes for h in graph_heads}
    out |= {(k, d, h, False) for k in (DECODE_ONE_SPLIT, DECODE_SPLITS) for d in {*st.graph_dtypes, st.timing_dtype}
            for h in graph_heads}
    return out


def _launch_variant(kind: str, spec: AttentionSpec, dtype: torch.dtype, lse: bool, device: torch.device,
                    gen: torch.Generator, rng: np.random.Generator) -> None:
    """One launch of a Triton variant on a tiny input (its compile, on a GPU)."""
    if kind == PREFILL_CAUSAL:
        meta, num_pages = paged_metadata(WARMUP_PLAN, spec.page_size, device, slots=SEGMENT_SLOTS)
        q, cache = random_inputs(spec, WARMUP_PLAN.num_rows + 8, num_pages, dtype, gen, device)
        out, lse_t = sentinel_outputs(q, lse)
        TritonAttention(spec).forward(q, cache, meta, out, lse_t)
        return
    lens, rows, width = WARMUP_DECODE
    case = decode_case(lens, spec, dtype, device, gen, rng, rows=rows, width=width)
    if kind == PREFILL_NONCAUSAL:
        run_noncausal(TritonAttention(spec), case, lse)
    else:
        run_decode_case(TritonDecodeAttention(spec, 1 if kind == DECODE_ONE_SPLIT else FORCED_SPLITS), case, lse)


# ---- backends against the reference ------------------------------------------------------
def run_noncausal(backend, case: DecodeCase, with_lse: bool):
    """An attention backend (not a decode kernel) on a decode step's live metadata (one
    query row a request over every key it holds: non-causal), against the reference."""
    out, lse = sentinel_outputs(case.q, with_lse)
    backend.prepare(case.live)
    backend.forward(case.q, case.kv(backend.spec.kv_layout), case.live, out, lse)
    if case.q.device.type == "cuda":
        torch.cuda.synchronize(case.q.device)
    return compare_decode(out, lse, case)


def decode_cases(st: Settings, spec: AttentionSpec, dtype: torch.dtype, seed: int) -> list[DecodeCase]:
    """The settings' decode steps (``st.decode_cases``) as reference cases."""
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    return [decode_case(list(lens), spec, dtype, torch.device(st.device), gen, rng, rows=rows, width=width)
            for lens, rows, width in st.decode_cases]

def _record(name: str, dtype_name: str, heads: tuple[int, int, int], causal: bool = True) -> dict:
    return {"backend": name, "causal": causal, "dtype": dtype_name, "num_q_heads": heads[0], "num_kv_heads": heads[1],
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


def _check_noncausal(name: str, cases: list[DecodeCase], spec: AttentionSpec, device: torch.device,
                     dtype: torch.dtype, rec: dict) -> None:
    """Backend ``name`` on decode steps (non-causal), with and without LSE, into ``rec``."""
    t0 = time.perf_counter()
    limits = AttentionLimits(max_segments=max(c.rows for c in cases), max_q_rows=max(c.rows for c in cases),
                             max_pages=max(c.num_pages for c in cases) + SEGMENT_SLOTS,
                             max_pages_per_segment=max(c.live.page_table_host.shape[1] for c in cases), dtype=dtype)
    errs = {"out": 0.0, "out_nolse": 0.0, "lse": 0.0}
    exact = True
    try:
        for case in cases:
            backend = make_attention(name, dataclasses.replace(spec, kv_layout=preferred_kv_layout(name, device)),
                                     device, limits)
            with_lse, without = run_noncausal(backend, case, True), run_noncausal(backend, case, False)
            errs = {"out": max(errs["out"], with_lse.out), "out_nolse": max(errs["out_nolse"], without.out),
                    "lse": max(errs["lse"], with_lse.lse or 0.0)}
            exact &= with_lse.padding_untouched and without.padding_untouched
            rec["plans"] += 1
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        fail(rec, f"check {name} non-causal {rec['dtype']} heads={spec.num_q_heads}/{spec.num_kv_heads}x"
                  f"{spec.head_dim}", e)
        return
    ok = max(errs.values()) <= rec["tol"] and exact
    rec.update(max_rel_err_out=errs["out"], max_rel_err_out_nolse=errs["out_nolse"], max_rel_err_lse=errs["lse"],
               padding_untouched=exact, status="pass" if ok else "fail", seconds=round(time.perf_counter() - t0, 3))
    log(f"check {name} non-causal {rec['dtype']} heads={spec.num_q_heads}/{spec.num_kv_heads}x{spec.head_dim}: "
        f"{rec['status']} out {errs['out']:.2e} lse {errs['lse']:.2e} ({rec['seconds']} s)")


def check_backends(st: Settings, budget: Budget, names: list[str]) -> list[dict]:
    """One record per (backend, causal or not, dtype, head config): max errors over the
    plans (causal: zigzag prefill plans; non-causal: decode steps, a row with no key
    exactly output 0 and LSE -inf) and pass/fail."""
    device = torch.device(st.device)
    rng = np.random.default_rng(st.seed)
    batches = edge_and_random_batches(rng, st.check_random_plans, st.check_max_extend, st.check_max_prefix)
    records: dict[tuple, dict] = {}
    for dtype_name in st.check_dtypes:
        dtype = getattr(torch, dtype_name)
        for heads in st.check_heads:
            for name in names:
                records[(name, dtype_name, heads)] = _record(name, dtype_name, heads)
                records[(name, dtype_name, heads, False)] = _record(name, dtype_name, heads, causal=False)
            if not budget.allows(5.0):
                for name in names:
                    skip(records[(name, dtype_name, heads)], TIME_BUDGET)
                    skip(records[(name, dtype_name, heads, False)], TIME_BUDGET)
                continue
            hq, hkv, d = heads
            spec = AttentionSpec(hq, hkv, d, st.page_size, d ** -0.5, "NHD")
            gen = torch.Generator().manual_seed(st.seed + d)
            try:
                cases = [(b, build_case(b.plan(), spec, dtype, device, gen, rng, slots=SEGMENT_SLOTS))
                         for b in batches]
            except Exception as e:  # noqa: BLE001 - the reference itself failed: every backend is unchecked
                for name in names:
                    for key in ((name, dtype_name, heads), (name, dtype_name, heads, False)):
                        records[key].update(status="error", error=f"reference: {err(e)}")
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
            steps = decode_cases(st, spec, dtype, st.seed + d + 1)
            for name in names:
                rec = records[(name, dtype_name, heads, False)]
                if dtype_name not in BACKEND_DTYPES.get(name, ("float32", "bfloat16")):
                    skip(rec, f"{name} does not take {dtype_name}")
                elif not budget.allows(3.0):
                    skip(rec, TIME_BUDGET)
                else:
                    _check_noncausal(name, steps, spec, device, dtype, rec)
            del steps
            free_device_memory(device)
    return list(records.values())
