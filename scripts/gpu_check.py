#!/usr/bin/env python
"""One-shot GPU check of graphcp: attention backends, eager vs graph timing,
launch counts and capture memory, in one run (under 8 minutes on one H200).

1. ``check_backends``: every available attention backend against the torch
   reference (:class:`TorchAttention` in float32 on the same, rounded inputs) on
   random zigzag plans with cached prefixes, a :class:`PagedKVCache` of random
   K/V, GQA, head_dim 64 and 128, float32 and bfloat16 where the backend takes
   them. Output and LSE (base e) are compared, and padding rows must stay
   untouched. A backend that raises is recorded as an error, not a crash.
2. ``time_paths``: CP = 1 prefill of one request of 1K, 8K and 32K new tokens,
   eager vs breakable-graph replay vs full-graph replay (where the backend can
   run inside a graph), for the ``default`` preset and a larger Qwen3-style
   config (``qwen3-1b-like``, by default cut to ``--large-layers 8`` layers to
   keep the run short). Warm-up, then the median of ``--repeats`` synchronised
   runs (the whole prefill: a time-to-first-token proxy). Kernels per forward
   come from ``torch.profiler`` (CUDA activity), host ops from a dispatch-mode
   counter, graph segments and breaks from the runner, pool bytes and capture
   time from ``engine.capture()``.
3. ``write_report``: JSON (``--out``) and a markdown table next to it
   (same name, ``.md``); the markdown is printed last on stdout (progress goes
   to stderr). Results are rewritten after every phase, so a run that dies
   leaves what it had.

A global budget (``--budget-s``, default 420 s) skips whatever is left, as
"skipped" rows, when time runs short; a measured row's repeats shrink to fit
``--item-cap-s``.

``--dry-run`` runs the same flow on the CPU: torch backend (and triton under
``TRITON_INTERPRET=1`` for the backend check when triton is importable), tiny
sizes, the default model only, the ``trace`` graph backend.

    python scripts/gpu_check.py --out results/gpu_check.json            # GPU box
    python scripts/gpu_check.py --dry-run --out /tmp/gc/gpu_check.json  # anywhere
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

if importlib.util.find_spec("graphcp") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA_VERSION = 1
PATHS = ("eager", "breakable", "full")
#: max relative error (max |x - ref| / max |ref|) a backend may show
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
#: dtypes each backend's kernels take (others are recorded as skipped, not as errors)
BACKEND_DTYPES = {
    "torch": ("float32", "bfloat16"),
    "triton": ("float32", "bfloat16"),
    "flashinfer": ("bfloat16",),
    "trtllm": ("bfloat16",),
}
#: order in which timing visits backends (the most interesting first, in case the budget runs out)
TIMING_ORDER = ("trtllm", "flashinfer", "triton", "torch")
SENTINEL = -1024.0  # exact in every dtype: padding rows must still hold it
PAD_ROWS = 5
LARGE_MODEL = "qwen3-1b-like"


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


# ----------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """Everything a run needs, resolved from the command line (and --dry-run)."""

    dry_run: bool
    device: str
    timing_dtype: str
    graph_backend: str
    # backend check
    check_dtypes: tuple[str, ...]
    check_heads: tuple[tuple[int, int, int], ...]  # (q heads, kv heads, head_dim)
    check_random_plans: int
    check_max_extend: int
    check_max_prefix: int
    check_page_size: int
    # timing
    models: tuple[str, ...]
    large_layers: int | None
    sizes: tuple[int, ...]
    backends: tuple[str, ...] | None  # None: every available one
    timing_backends: tuple[str, ...] | None  # None: the checked ones (dry run: torch; triton interprets too slowly)
    repeats: int
    warmup: int
    item_cap_s: float
    profile: bool
    page_size: int
    skip_check: bool
    skip_timing: bool
    seed: int


class Budget:
    """Wall-clock budget for the whole run; keeps ``reserve_s`` for the report."""

    def __init__(self, total_s: float, reserve_s: float) -> None:
        self.total_s, self.reserve_s = total_s, reserve_s
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def remaining(self) -> float:
        return self.total_s - self.reserve_s - self.elapsed()

    def allows(self, need_s: float) -> bool:
        return self.remaining() >= need_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- 1. backends


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
    cu: np.ndarray
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
    seg_table = table[rp.seg_request]
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen).to(dtype))
    rows = int(rp.cu_seqlens_q[-1])
    q = torch.randn(rows + PAD_ROWS, hq, d, generator=gen).to(dtype).to(device)
    kv = cache.layer(0)
    # reference: float32 torch attention on the very (rounded) inputs the backend sees
    spec = AttentionSpec(hq, hkv, d, page_size, d ** -0.5, "NHD")
    meta = AttentionMetadata.from_host(rp.cu_seqlens_q, rp.seg_kv_len, seg_table, page_size, device)
    ref_out = torch.zeros(rows + PAD_ROWS, hq, d, device=device)
    ref_lse = torch.zeros(rows + PAD_ROWS, hq, device=device)
    TorchAttention(spec).forward(q.float(), kv.float(), meta, ref_out, ref_lse)
    return PlanCase(plan, np.asarray(rp.cu_seqlens_q), np.asarray(rp.seg_kv_len), seg_table, num_pages,
                    q, kv.clone(), ref_out[:rows], ref_lse[:rows])


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
        _sync(device)
        padding_ok &= bool((out[rows:].float() == SENTINEL).all())
        if with_lse:
            res["out"] = _rel(out[:rows], case.ref_out, 1e-6)
            res["lse"] = _rel(lse[:rows], case.ref_lse, 1.0)
            padding_ok &= bool((lse[rows:] == SENTINEL).all())
        else:
            res["out_nolse"] = _rel(out[:rows], case.ref_out, 1e-6)
    res["padding_untouched"] = padding_ok
    return res


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
                    _skip(records[(name, dtype_name, heads)], "time budget")
                continue
            gen = torch.Generator().manual_seed(st.seed + heads[2])
            try:
                cases = [build_case(p, heads, dtype, st.check_page_size, device, gen, rng) for p in plans]
            except Exception as e:  # noqa: BLE001 - the reference itself failed: every backend is unchecked
                for name in names:
                    rec = records[(name, dtype_name, heads)]
                    rec.update(status="error", error=f"reference: {_err(e)}")
                log(f"reference failed ({dtype_name}, heads {heads}): {_err(e)}")
                continue
            limits = dict(
                max_segments=max(c.page_table.shape[0] for c in cases),
                max_pages=max(2 * c.num_pages + c.page_table.shape[0] for c in cases),
                max_pages_per_segment=max(c.page_table.shape[1] for c in cases),
                max_q_rows=max(c.q.shape[0] for c in cases),
            )
            for name in names:
                rec = records[(name, dtype_name, heads)]
                if dtype_name not in BACKEND_DTYPES.get(name, ("float32", "bfloat16")):
                    _skip(rec, f"{name} does not take {dtype_name}")
                    continue
                if not budget.allows(3.0):
                    _skip(rec, "time budget")
                    continue
                t0 = time.perf_counter()
                errs: dict[str, float] = {"out": 0.0, "out_nolse": 0.0, "lse": 0.0}
                padding = True
                try:
                    for case in cases:
                        r = _run_backend_on_case(name, case, heads, dtype, st.check_page_size, device, limits)
                        for k in errs:
                            errs[k] = max(errs[k], r[k])
                        padding &= r["padding_untouched"]
                        rec["plans"] += 1
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    rec.update(status="error", error=f"{_err(e)} (plan: {case.plan.label()})")
                    log(f"check {name} {dtype_name} heads={heads}: ERROR {_err(e)}")
                    log("".join(traceback.format_exception(e)[-3:]).rstrip())
                    continue
                tol = rec["tol"]
                ok = max(errs.values()) <= tol and padding
                rec.update(max_rel_err_out=errs["out"], max_rel_err_out_nolse=errs["out_nolse"],
                           max_rel_err_lse=errs["lse"], padding_untouched=padding,
                           status="pass" if ok else "fail", seconds=round(time.perf_counter() - t0, 3))
                log(f"check {name} {dtype_name} heads={heads}: {rec['status']} out {errs['out']:.2e} "
                    f"lse {errs['lse']:.2e} ({rec['seconds']} s)")
            del cases
            _free_device_memory(device)
    return list(records.values())


def _skip(rec: dict, reason: str) -> dict:
    rec.update(status="skipped", error=reason)
    return rec


# ----------------------------------------------------------------------------- 2. timing


def prepare_model(name: str, layers: int | None) -> tuple[Path, str]:
    """Checkpoint folder of preset ``name`` (written once, random weights), with
    ``num_hidden_layers`` cut to ``layers`` when given (its own cache folder)."""
    from graphcp.model.presets import PRESETS, cache_root, ensure_preset, random_weights

    if layers is None or layers == PRESETS[name]["num_hidden_layers"]:
        return ensure_preset(name), name
    label = f"{name}-{layers}l"
    folder = cache_root() / "models" / label
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder, label
    from safetensors.torch import save_file

    config = dict(PRESETS[name], num_hidden_layers=layers)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{label}-", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(random_weights(config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder, label


def count_launches(fn: Callable[[], Any], device: torch.device, profile: bool) -> dict:
    """What one call of ``fn`` launches: host ops dispatched (a dispatch-mode
    counter; a graph replay dispatches none of its captured ops) and, with
    ``profile`` on CUDA, kernels executed, kernel-launch API calls and graph
    launches from a ``torch.profiler`` trace."""
    from graphcp.cli.jobs import OpCounter

    res: dict[str, Any] = {}
    with OpCounter() as c:
        fn()
    _sync(device)
    res["host_ops"] = c.count
    if not profile:
        return res
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory() as tmp:
        with tprofile(activities=acts) as prof:
            fn()
            _sync(device)
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    res.update(trace_counts(events, device.type == "cuda"))
    return res


def trace_counts(events: list[dict], cuda: bool) -> dict:
    """Counts from a chrome trace: kernels, launch calls, graph launches, copies."""
    cats: dict[str, int] = {}
    launch_calls = graph_launches = 0
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        cats[cat] = cats.get(cat, 0) + 1
        if cat in ("cuda_runtime", "cuda_driver"):
            name = ev.get("name", "")
            if "GraphLaunch" in name:
                graph_launches += 1
            elif "LaunchKernel" in name or "LaunchCooperativeKernel" in name:
                launch_calls += 1
    if not cuda:
        return {"profiled_cpu_ops": cats.get("cpu_op", 0)}
    return {
        "kernels": cats.get("kernel", 0),
        "kernel_launch_calls": launch_calls,
        "graph_launches": graph_launches,
        "memcpy": cats.get("gpu_memcpy", 0),
        "memset": cats.get("gpu_memset", 0),
    }


def _row(model: str, backend: str, path: str, tokens: int, **kw) -> dict:
    return {"model": model, "backend": backend, "path": path, "tokens": tokens, "status": "pending", **kw}


def _measure(engine, tokens: np.ndarray, path: str, st: Settings, budget: Budget, row: dict) -> Any:
    """Warm up, then time ``st.repeats`` prefills (fewer when they would not fit
    ``st.item_cap_s`` or the budget). Returns the last output."""
    from graphcp import Request

    device = engine.device
    force_eager = path == "eager"

    def forward():
        out = engine.prefill([Request(tokens)], force_eager=force_eager)
        for h in out.handles:
            engine.release(h)
        return out

    warm = []
    for _ in range(max(1, st.warmup)):
        _sync(device)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        warm.append(time.perf_counter() - t0)
        if warm[-1] * 3 > budget.remaining():
            break
    per = warm[-1]
    reps = max(1, min(st.repeats, int(st.item_cap_s / max(per, 1e-6)), int(budget.remaining() / max(per, 1e-6))))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        times.append(time.perf_counter() - t0)
    info = out.info
    row.update(
        status="ok", median_ms=1e3 * float(np.median(times)), min_ms=1e3 * min(times), repeats=reps,
        warmup_ms=[round(1e3 * w, 3) for w in warm], times_ms=[round(1e3 * t, 3) for t in times],
        tokens_per_s=len(tokens) / float(np.median(times)), ran=info.path, bucket=info.capacity if info.path == "graph"
        else None, fallback=info.fallback,
        host_timings_ms={k: round(1e3 * v, 3) for k, v in info.timings.items()},
    )
    if device.type == "cuda":
        row["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(device))
    if path != "eager" and info.path != "graph":
        row["status"] = "fallback"
        row["error"] = f"ran eagerly: {info.fallback}"
    if path != "eager" and info.path == "graph":
        g = engine.runner.graphs[info.capacity].graph
        row.update(segments=len(g.segments), breaks=len(g.breaks))
    return out


def _engine(model_dir: Path, backend: str, graph: str, st: Settings, kv_tokens: int, caps: tuple[int, ...]):
    from graphcp.capture.buckets import BucketSet
    from graphcp.config import RuntimeConfig
    from graphcp import PrefillEngine

    rt = RuntimeConfig(device=st.device, dtype=st.timing_dtype, graph=graph, attention=backend,
                       kv_tokens=kv_tokens, page_size=st.page_size, graph_backend=st.graph_backend, max_requests=4)
    return PrefillEngine(model_dir, rt, None, BucketSet(caps))


def _graph_modes(backend: str) -> tuple[str, ...]:
    return ("breakable", "full")


def _open_engine(model_label: str, model_dir: Path, backend: str, graph: str, st: Settings, caps: tuple[int, ...],
                 rows: list[dict], captures: list[dict] | None):
    """Build and capture an engine; on failure mark ``rows`` (skipped when the
    backend cannot run a full graph, error otherwise) and return None."""
    from graphcp.config import ConfigError

    device = torch.device(st.device)
    engine = None
    try:
        t0 = time.perf_counter()
        engine = _engine(model_dir, backend, graph, st, max(caps) + 4 * st.page_size, caps)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = engine.capture()
        log(f"{model_label}/{backend}/{graph}: engine {build_s:.1f} s, captured {len(stats)} bucket(s) in "
            f"{time.perf_counter() - t0:.1f} s")
        for s in stats if captures is not None else ():
            captures.append({"model": model_label, "backend": backend, "graph": graph, "capacity": s.capacity,
                             "capture_s": s.capture_s, "pool_bytes": s.pool_bytes, "segments": s.segments,
                             "breaks": s.breaks})
        return engine
    except Exception as e:  # noqa: BLE001
        unsupported = isinstance(e, ConfigError) and graph == "full"
        for r in rows:
            if unsupported:
                _skip(r, f"not supported: {backend} attention cannot run inside a full graph")
            else:
                r.update(status="error", error=_err(e))
        if not unsupported:
            log(f"{model_label}/{backend}/{graph}: ERROR {_err(e)}")
            log("".join(traceback.format_exception(e)[-3:]).rstrip())
        del engine
        _free_device_memory(device)
        return None


def _tokens(st: Settings, n: int, vocab: int) -> np.ndarray:
    """The batch of ``n`` new tokens: the same on every path, so logits compare."""
    return np.random.default_rng(st.seed + n).integers(0, vocab, n)


def time_paths(model_label: str, model_dir: Path, backend: str, st: Settings, budget: Budget) -> dict:
    """Eager, breakable and (where supported) full-graph prefill of one request
    of each size: timing rows and capture stats. Eager runs on the breakable
    engine (``force_eager``); the full graph gets an engine of its own."""
    from graphcp.capture.buckets import align_up

    device = torch.device(st.device)
    out: dict[str, list] = {"timing": [], "captures": []}
    sizes = list(st.sizes)
    caps = tuple(sorted({int(align_up(s, 8)) for s in sizes}))
    eager_logits: dict[int, torch.Tensor] = {}
    for graph in _graph_modes(backend):
        paths = ("eager", "breakable") if graph == "breakable" else ("full",)
        rows = {(p, n): _row(model_label, backend, p, n) for p in paths for n in sizes}
        out["timing"].extend(rows.values())
        if not budget.allows(10.0):
            for r in rows.values():
                _skip(r, "time budget")
            continue
        engine = _open_engine(model_label, model_dir, backend, graph, st, caps, list(rows.values()), out["captures"])
        if engine is None:
            continue
        for n in sizes:
            tokens = _tokens(st, n, engine.cfg.vocab_size)
            for p in paths:
                r = rows[(p, n)]
                if not budget.allows(2.0):
                    _skip(r, "time budget")
                    continue
                try:
                    res = _measure(engine, tokens, p, st, budget, r)
                    last = res.last_logits.float()
                    if p == "eager":
                        eager_logits[n] = last
                    elif n in eager_logits:
                        ref = eager_logits[n]
                        r["logits_rel_diff_vs_eager"] = float((last - ref).norm() / max(float(ref.norm()), 1e-30))
                    log(f"{model_label}/{backend}/{p} {n} tokens: {r['median_ms']:.2f} ms (n={r['repeats']}, "
                        f"ran {r['ran']})")
                except Exception as e:  # noqa: BLE001
                    r.update(status="error", error=_err(e))
                    log(f"{model_label}/{backend}/{p} {n}: ERROR {_err(e)}")
                    log("".join(traceback.format_exception(e)[-3:]).rstrip())
        del engine
        _free_device_memory(device)
    return out


def count_paths(model_label: str, model_dir: Path, backend: str, st: Settings, budget: Budget) -> list[dict]:
    """Launches per forward on each path at the smallest size (the count does not
    grow with the tokens), on engines holding that one bucket. Runs after all
    the timing: the profiler (CUPTI) attaching to CUDA graphs is the riskiest
    step of the run, so nothing else waits behind it."""
    from graphcp.capture.buckets import align_up
    from graphcp import Request

    device = torch.device(st.device)
    n = min(st.sizes)
    caps = (int(align_up(n, 8)),)
    rows_all = []
    for graph in _graph_modes(backend):
        paths = ("eager", "breakable") if graph == "breakable" else ("full",)
        rows = {p: _row(model_label, backend, p, n) for p in paths}
        rows_all.extend(rows.values())
        if not budget.allows(10.0):
            for r in rows.values():
                _skip(r, "time budget")
            continue
        engine = _open_engine(model_label, model_dir, backend, graph, st, caps, list(rows.values()), None)
        if engine is None:
            continue
        tokens = _tokens(st, n, engine.cfg.vocab_size)
        for p, r in rows.items():
            if not budget.allows(5.0):
                _skip(r, "time budget")
                continue

            def forward(p=p, r=r):
                o = engine.prefill([Request(tokens)], force_eager=p == "eager")
                for h in o.handles:
                    engine.release(h)
                r["ran"] = o.info.path
                if o.info.path == "graph":
                    g = engine.runner.graphs[o.info.capacity].graph
                    r.update(segments=len(g.segments), breaks=len(g.breaks))

            try:
                forward()  # warm (lazy init stays out of the count)
                r.update(count_launches(forward, device, st.profile))
                r["status"] = "ok"
                log(f"{model_label}/{backend}/{p}: {r.get('kernels', '-')} kernels, {r['host_ops']} host ops")
            except Exception as e:  # noqa: BLE001
                r.update(status="error", error=_err(e))
                log(f"{model_label}/{backend}/{p}: launch count ERROR {_err(e)}")
        del engine
        _free_device_memory(device)
    return rows_all


# ----------------------------------------------------------------------------- 3. report


def _fmt(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return format(x, spec)
    return str(x)


def _mib(b: Any) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in r) + " |" for r in rows]
    return lines


def _short(s: Any, n: int = 110) -> str:
    s = "" if s is None else str(s)
    return s if len(s) <= n else s[: n - 3] + "..."


def render_markdown(res: dict) -> str:
    env, dev = res["env"], res["device"]
    out = [f"# graphcp GPU check{' (dry run, CPU)' if res['dry_run'] else ''}", ""]
    out.append(f"{dev['name']} (capability {dev.get('capability') or '-'}), torch {env['torch']}, "
               f"triton {env.get('triton') or '-'}, flashinfer {env.get('flashinfer') or '-'}, "
               f"CUDA {env.get('cuda') or '-'}; {res['elapsed_s']:.0f} s of a {res['budget_s']:.0f} s budget; "
               f"{res['started_at']}")
    out.append("")
    checks = res["backends"]["checks"]
    if checks:
        out += [f"## Attention backends vs the torch reference ({', '.join(res['backends']['available'])})", "",
                "max |x - ref| / max |ref| over zigzag plans with prefixes (LSE: / max(|ref|, 1)); "
                "padding rows must keep their sentinel.", ""]
        out += _table(
            ["backend", "dtype", "heads q/kv", "head_dim", "plans", "out err", "out err (no lse)", "lse err",
             "padding untouched", "tol", "status"],
            [[c["backend"], c["dtype"], f"{c['num_q_heads']}/{c['num_kv_heads']}", str(c["head_dim"]),
              str(c["plans"]), _fmt(c["max_rel_err_out"], ".2e"), _fmt(c["max_rel_err_out_nolse"], ".2e"),
              _fmt(c["max_rel_err_lse"], ".2e"), _fmt(c["padding_untouched"]), _fmt(c["tol"], ".0e"),
              c["status"] + (f": {_short(c['error'], 60)}" if c["status"] in ("error", "skipped") else "")]
             for c in checks])
        out.append("")
    if res["captures"]:
        out += ["## Capture (per bucket)", ""]
        out += _table(["model", "attention", "graph", "bucket", "capture s", "pool MiB", "segments", "breaks"],
                      [[c["model"], c["backend"], c["graph"], str(c["capacity"]), _fmt(c["capture_s"], ".2f"),
                        _mib(c["pool_bytes"]), str(c["segments"]), str(c["breaks"])] for c in res["captures"]])
        out.append("")
    if res["launches"]:
        out += ["## Launches per forward", "",
                "kernels: device kernels in one forward (torch.profiler, CUDA graph kernels included); launch calls: "
                "kernel-launch API calls on the host; host ops: torch ops dispatched on the host.", ""]
        out += _table(["model", "attention", "path", "tokens", "kernels", "launch calls", "graph launches",
                       "host ops", "segments + breaks", "status"],
                      [[r["model"], r["backend"], r["path"], str(r["tokens"]), _fmt(r.get("kernels")),
                        _fmt(r.get("kernel_launch_calls")), _fmt(r.get("graph_launches")), _fmt(r.get("host_ops")),
                        f"{r['segments']} + {r['breaks']}" if "segments" in r else "-",
                        r["status"] + (f": {_short(r.get('error'), 60)}" if r["status"] != "ok" else "")]
                       for r in res["launches"]])
        out.append("")
    problems = [("check", f"{c['backend']} {c['dtype']} {c['num_q_heads']}/{c['num_kv_heads']}x{c['head_dim']}",
                 c["status"], c["error"]) for c in checks if c["status"] in ("error", "fail")]
    problems += [("timing", f"{r['model']} {r['backend']} {r['path']} {r['tokens']}", r["status"], r.get("error"))
                 for r in res["timing"] if r["status"] in ("error", "fallback")]
    problems += [("run", "", "error", e) for e in res.get("errors", [])]
    if problems:
        out += ["## Errors", ""]
        out += _table(["where", "what", "status", "message"], [[a, b, c, _short(d, 160)] for a, b, c, d in problems])
        out.append("")
    if res["timing"]:
        eager = {(r["model"], r["backend"], r["tokens"]): r.get("median_ms") for r in res["timing"]
                 if r["path"] == "eager" and r["status"] == "ok"}
        out += [f"## Prefill time, CP = 1, one request ({res['settings']['timing_dtype']}; "
                f"median of up to {res['settings']['repeats']} after warm-up; TTFT proxy)", ""]
        rows = []
        for r in res["timing"]:
            e = eager.get((r["model"], r["backend"], r["tokens"]))
            ms = r.get("median_ms")
            speed = f"{e / ms:.2f}x" if e and ms and r["path"] != "eager" else "-"
            rows.append([r["model"], r["backend"], str(r["tokens"]), r["path"], _fmt(ms, ".2f"),
                         _fmt(r.get("min_ms"), ".2f"), _fmt(r.get("repeats")), _fmt(r.get("tokens_per_s"), ".3g"),
                         speed, _fmt(r.get("bucket")), _fmt(r.get("logits_rel_diff_vs_eager"), ".1e"),
                         _mib(r.get("peak_mem_bytes")),
                         r["status"] + (f": {_short(r.get('error'), 50)}" if r["status"] != "ok" else "")])
        out += _table(["model", "attention", "tokens", "path", "prefill ms", "min ms", "n", "tokens/s", "vs eager",
                       "bucket", "logits rel diff", "peak MiB", "status"], rows)
    return "\n".join(out).rstrip() + "\n"


def write_report(res: dict, out: Path, profiles_dir: Path | None = None) -> str:
    """Write ``out`` (JSON) and ``out`` with ``.md``; return the markdown."""
    md = render_markdown(res)
    targets = [out]
    if profiles_dir is not None:
        targets.append(Path(profiles_dir) / res["device"]["slug"] / "gpu_check.json")
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(res, indent=2, default=str) + "\n")
        tmp.replace(path)
        path.with_suffix(".md").write_text(md)
    return md


# ----------------------------------------------------------------------------- main


def _device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        mem = torch.cuda.get_device_properties(device).total_memory
    else:
        name, cap, mem = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", None, None
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = f"gpu-{slug}" if device.type == "cuda" else "cpu-dry-run"
    return {"type": device.type, "name": name, "capability": cap, "total_memory_bytes": mem, "slug": slug}


def _env_info() -> dict:
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": version("triton"),
            "flashinfer": version("flashinfer-python") or version("flashinfer"), "python": platform.python_version(),
            "graphcp": version("graphcp"), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check_results/gpu_check.json",
                   help="JSON results path; the markdown goes next to it with .md (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="the whole flow on the CPU at tiny sizes")
    p.add_argument("--models", default=None,
                   help=f"comma-separated presets to time (default: default,{LARGE_MODEL}; dry run: default)")
    p.add_argument("--skip-large", action="store_true", help=f"do not time {LARGE_MODEL}")
    p.add_argument("--large-layers", type=int, default=8,
                   help=f"num_hidden_layers of {LARGE_MODEL} (default %(default)s of its 16, to keep the run "
                        "short; 0: the preset's own)")
    p.add_argument("--sizes", default=None, help="new tokens per timed prefill (default 1024,8192,32768; dry run 64,256)")
    p.add_argument("--backends", default=None,
                   help="comma-separated attention backends (default: every available; the dry run times torch only)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per row (default 5; dry run 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per row (default 2; dry run 1)")
    p.add_argument("--item-cap-s", type=float, default=None,
                   help="seconds one timed row may take; repeats shrink to fit (default 8; dry run 2)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="wall-clock budget; what is left when it runs short is recorded as skipped (default %(default)s)")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler kernel counts")
    p.add_argument("--no-triton", action="store_true", help="dry run: leave triton out of the backend check")
    p.add_argument("--skip-check", action="store_true", help="skip the backend check")
    p.add_argument("--skip-timing", action="store_true", help="skip the timing")
    p.add_argument("--profiles-dir", default=None,
                   help="also write the results to PROFILES_DIR/<device slug>/gpu_check.{json,md} (e.g. profiles/)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _csv(s: str | None, cast=str) -> tuple | None:
    return None if s is None else tuple(cast(x) for x in s.split(",") if x.strip())


def settings_from_args(a: argparse.Namespace) -> Settings:
    dry = a.dry_run
    models = _csv(a.models) or (("default",) if dry else ("default", LARGE_MODEL))
    if a.skip_large:
        models = tuple(m for m in models if m != LARGE_MODEL)
    return Settings(
        dry_run=dry,
        device="cpu" if dry else "cuda",
        timing_dtype="float32" if dry else "bfloat16",
        graph_backend="trace" if dry else "cuda",
        check_dtypes=("float32", "bfloat16"),
        check_heads=((2, 1, 64), (2, 1, 128)) if dry else ((8, 2, 64), (16, 4, 128)),
        check_random_plans=1 if dry else 4,
        check_max_extend=24 if dry else 3000,
        check_max_prefix=20 if dry else 2000,
        check_page_size=16,
        models=models,
        large_layers=a.large_layers or None,
        sizes=_csv(a.sizes, int) or ((64, 256) if dry else (1024, 8192, 32768)),
        backends=_csv(a.backends),
        timing_backends=_csv(a.backends) or (("torch",) if dry else None),
        repeats=a.repeats or (2 if dry else 5),
        warmup=a.warmup or (1 if dry else 2),
        item_cap_s=a.item_cap_s or (2.0 if dry else 8.0),
        profile=not a.no_profile,
        page_size=16,
        skip_check=a.skip_check,
        skip_timing=a.skip_timing,
        seed=a.seed,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    st = settings_from_args(args)
    if st.dry_run and not args.no_triton:
        # the triton backend runs on CPU only under the interpreter, chosen before its kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not st.dry_run:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run with --dry-run to exercise the flow on the CPU",
                  file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            log("warning: TRITON_INTERPRET is set: triton kernels would run in the interpreter; unset it")
        torch.set_float32_matmul_precision("highest")  # the float32 reference without TF32
    from graphcp.attention.registry import available_backends

    budget = Budget(args.budget_s, reserve_s=2.0 if st.dry_run else 10.0)
    device = torch.device(st.device)
    out = Path(args.out)
    profiles = Path(args.profiles_dir) if args.profiles_dir else None
    available = available_backends(device)
    if st.dry_run and args.no_triton and "triton" in available:
        available.remove("triton")
    names = [b for b in available if st.backends is None or b in st.backends]
    missing = [b for b in (st.backends or ()) if b not in available]
    res: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "dry_run": st.dry_run,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": 0.0, "budget_s": args.budget_s, "device": _device_info(device), "env": _env_info(),
        "settings": {k: v for k, v in vars(st).items()}, "argv": list(argv) if argv is not None else sys.argv[1:],
        "backends": {"available": available, "checked": names, "checks": []},
        "models": {}, "timing": [], "launches": [], "captures": [], "errors": [],
    }
    if missing:
        res["errors"].append(f"requested backends not available here: {missing}")

    def save() -> str:
        res["elapsed_s"] = round(budget.elapsed(), 2)
        return write_report(res, out, profiles)

    log(f"device {res['device']['name']}; backends available: {available}; budget {args.budget_s:.0f} s")
    if not st.skip_check:
        try:
            res["backends"]["checks"] = check_backends(st, budget, names)
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"backend check: {_err(e)}")
            log(traceback.format_exc())
        save()
    if not st.skip_timing:
        timed = [b for b in names if st.timing_backends is None or b in st.timing_backends]
        order = sorted(timed, key=lambda b: TIMING_ORDER.index(b) if b in TIMING_ORDER else len(TIMING_ORDER))
        prepared: list[tuple[str, Path]] = []
        for model in st.models:
            try:
                if not budget.allows(20.0):
                    raise TimeoutError("time budget")
                t0 = time.perf_counter()
                layers = st.large_layers if model == LARGE_MODEL else None
                folder, label = prepare_model(model, layers)
                res["models"][label] = {"preset": model, "dir": str(folder), "prepare_s": time.perf_counter() - t0,
                                        "config": json.loads((folder / "config.json").read_text())}
                log(f"model {label} ready at {folder} ({time.perf_counter() - t0:.1f} s)")
            except Exception as e:  # noqa: BLE001
                status = "skipped" if isinstance(e, TimeoutError) else "error"
                for b in order:
                    for p in PATHS:
                        for n in st.sizes:
                            res["timing"].append({**_row(model, b, p, n), "status": status, "error": _err(e)})
                if status == "error":
                    res["errors"].append(f"model {model}: {_err(e)}")
                save()
                continue
            prepared.append((label, folder))
            for b in order:
                try:
                    got = time_paths(label, folder, b, st, budget)
                except Exception as e:  # noqa: BLE001
                    res["errors"].append(f"timing {label}/{b}: {_err(e)}")
                    log(traceback.format_exc())
                    continue
                for k in ("timing", "captures"):
                    res[k].extend(got[k])
                save()
        # launch counts last (see count_paths)
        for label, folder in prepared:
            for b in order:
                try:
                    res["launches"].extend(count_paths(label, folder, b, st, budget))
                except Exception as e:  # noqa: BLE001
                    res["errors"].append(f"launch count {label}/{b}: {_err(e)}")
                    log(traceback.format_exc())
                save()
    md = save()
    log(f"wrote {out} and {out.with_suffix('.md')}"
        + (f" and {profiles / res['device']['slug']}/gpu_check.{{json,md}}" if profiles else ""))
    sys.stderr.flush()
    print(md, end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
