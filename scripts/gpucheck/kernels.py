"""Attention kernels: Triton warm-up (every variant the run will launch compiled
first, compiles counted, registers and spills read from the compiled kernels)
and every available backend against the torch reference.

The reference is :class:`TorchAttention` in float32 (no TF32) on the same,
rounded inputs. Plans are zigzag ranks with cached prefixes and requests shorter
than 2C (empty segments), padded with empty segments to :data:`SEGMENT_SLOTS`
as a full graph's static metadata is, over a :class:`PagedKVCache` of random
K/V whose pages are scattered.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpucheck.common import Budget, Settings, err, free_device_memory, log, sync

#: max relative error (max |x - ref| / max |ref|) a backend may show
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
#: dtypes each backend's kernels take (others are recorded as skipped, not as errors)
BACKEND_DTYPES = {
    "torch": ("float32", "bfloat16"),
    "triton": ("float32", "bfloat16"),
    "flashinfer": ("bfloat16",),
    "trtllm": ("bfloat16",),
}
SENTINEL = -1024.0  # exact in every dtype: padding rows must still hold it
PAD_ROWS = 5
SEGMENT_SLOTS = 16  # every plan's metadata is padded to this many segments


# ---- Triton warm-up -----------------------------------------------------------------------
def triton_compiled_kernels() -> list[Any] | None:
    """The compiled variants of graphcp's Triton kernel so far (None when interpreted)."""
    import sys

    tk = sys.modules.get("graphcp.attention.triton_kernel")
    caches = getattr(getattr(tk, "_paged_prefill_kernel", None), "device_caches", None)
    if caches is None:
        return None
    out = []
    for entry in caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cache, dict):
            out.extend(cache.values())
    return out


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
    from graphcp.attention.base import AttentionMetadata, AttentionSpec
    from graphcp.attention.triton_backend import TritonAttention

    device = torch.device(st.device)
    variants = {(d, h, True) for d in st.check_dtypes for h in st.check_heads}
    variants |= {(d, h, False) for d in st.check_dtypes for h in st.check_heads}
    variants |= {(st.timing_dtype, h, False) for h in timed_heads}
    variants |= {(d, h, False) for d in st.graph_dtypes for h in graph_heads}
    res: dict[str, Any] = {"variants": len(variants), "launched": 0, "status": "ok"}
    t0 = time.perf_counter()
    ps = st.page_size
    for dtype_name, (hq, hkv, d), lse in sorted(variants):
        if not budget.allows(5.0):
            res["status"] = "skipped: time budget"
            break
        dtype = getattr(torch, dtype_name)
        spec = AttentionSpec(hq, hkv, d, ps, d ** -0.5, "NHD")
        # 2 requests of 20 tokens over 2 pages each, padded to the slot count like the checks
        cu = np.zeros(SEGMENT_SLOTS + 1, np.int32)
        cu[1:] = 40
        cu[1] = 20
        kv = np.zeros(SEGMENT_SLOTS, np.int32)
        kv[:2] = 20
        table = np.zeros((SEGMENT_SLOTS, 2), np.int32)
        table[0], table[1] = (1, 2), (3, 4)
        meta = AttentionMetadata.from_host(cu, kv, table, ps, device)
        q = torch.randn(48, hq, d, device=device).to(dtype)
        cache = torch.randn(5, 2, ps, hkv, d, device=device).to(dtype)
        out = torch.empty_like(q)
        lse_t = torch.empty(48, hq, device=device) if lse else None
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
@dataclass
class CheckPlan:
    cp: int
    rank: int
    extend: list[int]
    prefix: list[int]

    def label(self) -> str:
        return f"cp={self.cp} rank={self.rank} extend={self.extend} prefix={self.prefix}"


def check_plans(st: Settings, rng: np.random.Generator) -> list[CheckPlan]:
    """Fixed edge cases (empty zigzag blocks, one long request) plus random plans."""
    big, pre = st.check_max_extend, st.check_max_prefix
    plans = [
        CheckPlan(1, 0, [big], [pre // 2]),  # one request, prefix, cp 1
        CheckPlan(4, 3, [3, 1, big // 2, 7], [0, pre, 5, 0]),  # requests shorter than 2C: empty segments
    ]
    for _ in range(st.check_random_plans):
        cp = int(rng.choice([1, 2, 4, 8]))
        n = int(rng.integers(1, 5))
        extend = [int(x) for x in rng.integers(1, big + 1, n)]
        prefix = [int(x) if rng.random() < 0.7 else 0 for x in rng.integers(0, pre + 1, n)]
        plans.append(CheckPlan(cp, int(rng.integers(cp)), extend, prefix))
    return plans


@dataclass
class PlanCase:
    """One plan's inputs and its float32 reference, shared by every backend."""

    plan: CheckPlan
    cu: np.ndarray  # padded to SEGMENT_SLOTS segments
    kv_lens: np.ndarray
    page_table: np.ndarray
    num_pages: int
    q: torch.Tensor  # [rows + PAD_ROWS, Hq, D] in the checked dtype
    kv_nhd: torch.Tensor  # [pages, 2, page_size, Hkv, D] in the checked dtype
    ref_out: torch.Tensor  # float32 [rows, Hq, D]
    ref_lse: torch.Tensor  # float32 [rows, Hq]


def build_case(plan: CheckPlan, heads: tuple[int, int, int], dtype: torch.dtype, page_size: int,
               device: torch.device, gen: torch.Generator, rng: np.random.Generator) -> PlanCase:
    from graphcp.attention.base import AttentionMetadata, AttentionSpec
    from graphcp.attention.torch_ref import TorchAttention
    from graphcp.cp import ZigzagLayout
    from graphcp.kvcache import PagedKVCache

    hq, hkv, d = heads
    rp = ZigzagLayout(plan.cp).plan(plan.extend, plan.prefix).rank(plan.rank)
    totals = [e + p for e, p in zip(plan.extend, plan.prefix)]
    need = sum(-(-t // page_size) for t in totals)
    num_pages = need + 2 * len(totals) + 8
    cache = PagedKVCache(1, num_pages, page_size, hkv, d, dtype, device, "NHD")
    # scatter each request's pages: reserve junk between requests, then release it
    seq_ids, junk = [], []
    for t in totals:
        seq_ids += cache.extend([None], [t])
        junk += cache.extend([None], [int(rng.integers(1, 3)) * page_size])
    for sid in junk:
        cache.release(cache.handle(sid))
    table = cache.page_table(seq_ids)
    table = np.concatenate([table, np.zeros((table.shape[0], 1), np.int32)], axis=1)  # a spare column
    s = len(rp.seg_kv_len)
    if s > SEGMENT_SLOTS:
        raise ValueError(f"plan has {s} segments, more than SEGMENT_SLOTS={SEGMENT_SLOTS}")
    rows = int(rp.cu_seqlens_q[-1])
    cu = np.full(SEGMENT_SLOTS + 1, rows, np.int32)  # empty padding segments, as a full graph's metadata
    cu[: s + 1] = rp.cu_seqlens_q
    kv_lens = np.zeros(SEGMENT_SLOTS, np.int32)
    kv_lens[:s] = rp.seg_kv_len
    seg_table = np.zeros((SEGMENT_SLOTS, table.shape[1]), np.int32)
    seg_table[:s] = table[rp.seg_request]
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen).to(dtype))
    q = torch.randn(rows + PAD_ROWS, hq, d, generator=gen).to(dtype).to(device)
    kv = cache.layer(0)
    spec = AttentionSpec(hq, hkv, d, page_size, d ** -0.5, "NHD")
    meta = AttentionMetadata.from_host(cu, kv_lens, seg_table, page_size, device)
    ref_out = torch.zeros(rows + PAD_ROWS, hq, d, device=device)
    ref_lse = torch.zeros(rows + PAD_ROWS, hq, device=device)
    TorchAttention(spec).forward(q.float(), kv.float(), meta, ref_out, ref_lse)
    return PlanCase(plan, cu, kv_lens, seg_table, num_pages, q, kv.clone(), ref_out[:rows], ref_lse[:rows])


def _rel(x: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    """max |x - ref| / max(max |ref|, floor); a NaN or inf anywhere counts as inf (a failure)."""
    if ref.numel() == 0:
        return 0.0
    val = float((x.float() - ref).abs().max() / max(float(ref.abs().max()), floor))
    return val if math.isfinite(val) else math.inf


def _run_backend_on_case(name: str, case: PlanCase, heads, dtype, page_size, device, limits) -> dict:
    """Output and LSE errors of backend ``name`` on one case (with and without LSE)."""
    from graphcp.attention.base import AttentionMetadata, AttentionSpec
    from graphcp.attention.registry import make_attention, preferred_kv_layout

    hq, hkv, d = heads
    layout = preferred_kv_layout(name, device)
    spec = AttentionSpec(hq, hkv, d, page_size, d ** -0.5, layout)
    backend = make_attention(name, spec, device, dtype=dtype, **limits)
    kv = case.kv_nhd if layout == "NHD" else case.kv_nhd.transpose(2, 3).contiguous()
    meta = AttentionMetadata.from_host(case.cu, case.kv_lens, case.page_table, page_size, device)
    rows = meta.num_q_rows
    res: dict[str, Any] = {}
    padding_ok = True
    for with_lse in (True, False):
        out = torch.full_like(case.q, SENTINEL)
        lse = torch.full(case.q.shape[:2], SENTINEL, dtype=torch.float32, device=device) if with_lse else None
        backend.prepare(meta)
        backend.forward(case.q, kv, meta, out, lse)
        sync(device)
        padding_ok &= bool((out[rows:].float() == SENTINEL).all())
        if with_lse:
            res["out"] = _rel(out[:rows], case.ref_out, 1e-6)
            res["lse"] = _rel(lse[:rows], case.ref_lse, 1.0)
            padding_ok &= bool((lse[rows:] == SENTINEL).all())
        else:
            res["out_nolse"] = _rel(out[:rows], case.ref_out, 1e-6)
    res["padding_untouched"] = padding_ok
    return res


def skip(rec: dict, reason: str) -> dict:
    rec.update(status="skipped", error=reason)
    return rec


def check_backends(st: Settings, budget: Budget, names: list[str]) -> list[dict]:
    """One record per (backend, dtype, head config): max errors over the plans and pass/fail."""
    device = torch.device(st.device)
    rng = np.random.default_rng(st.seed)
    plans = check_plans(st, rng)
    records: dict[tuple, dict] = {}
    for dtype_name in st.check_dtypes:
        dtype = getattr(torch, dtype_name)
        for heads in st.check_heads:
            for name in names:
                records[(name, dtype_name, heads)] = {
                    "backend": name, "dtype": dtype_name, "num_q_heads": heads[0], "num_kv_heads": heads[1],
                    "head_dim": heads[2], "plans": 0, "max_rel_err_out": None, "max_rel_err_out_nolse": None,
                    "max_rel_err_lse": None, "padding_untouched": None, "tol": TOLERANCE[dtype_name],
                    "status": "pending", "error": None,
                }
            if not budget.allows(5.0):
                for name in names:
                    skip(records[(name, dtype_name, heads)], "time budget")
                continue
            gen = torch.Generator().manual_seed(st.seed + heads[2])
            try:
                cases = [build_case(p, heads, dtype, st.page_size, device, gen, rng) for p in plans]
            except Exception as e:  # noqa: BLE001 - the reference itself failed: every backend is unchecked
                for name in names:
                    records[(name, dtype_name, heads)].update(status="error", error=f"reference: {err(e)}")
                log(f"reference failed ({dtype_name}, heads {heads}): {err(e)}")
                continue
            limits = dict(
                max_segments=SEGMENT_SLOTS,
                max_pages=max(2 * c.num_pages + SEGMENT_SLOTS for c in cases),
                max_pages_per_segment=max(c.page_table.shape[1] for c in cases),
                max_q_rows=max(c.q.shape[0] for c in cases),
            )
            for name in names:
                rec = records[(name, dtype_name, heads)]
                if dtype_name not in BACKEND_DTYPES.get(name, ("float32", "bfloat16")):
                    skip(rec, f"{name} does not take {dtype_name}")
                    continue
                if not budget.allows(3.0):
                    skip(rec, "time budget")
                    continue
                t0 = time.perf_counter()
                errs: dict[str, float] = {"out": 0.0, "out_nolse": 0.0, "lse": 0.0}
                padding = True
                case = cases[0]
                try:
                    for case in cases:
                        r = _run_backend_on_case(name, case, heads, dtype, st.page_size, device, limits)
                        for k in errs:
                            errs[k] = max(errs[k], r[k])
                        padding &= r["padding_untouched"]
                        rec["plans"] += 1
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    rec.update(status="error", error=f"{err(e)} (plan: {case.plan.label()})")
                    log(f"check {name} {dtype_name} heads={heads}: ERROR {err(e)}")
                    log("".join(traceback.format_exception(e)[-3:]).rstrip())
                    continue
                ok = max(errs.values()) <= rec["tol"] and padding
                rec.update(max_rel_err_out=errs["out"], max_rel_err_out_nolse=errs["out_nolse"],
                           max_rel_err_lse=errs["lse"], padding_untouched=padding,
                           status="pass" if ok else "fail", seconds=round(time.perf_counter() - t0, 3))
                log(f"check {name} {dtype_name} heads={heads}: {rec['status']} out {errs['out']:.2e} "
                    f"lse {errs['lse']:.2e} ({rec['seconds']} s)")
            del cases
            free_device_memory(device)
    return list(records.values())
