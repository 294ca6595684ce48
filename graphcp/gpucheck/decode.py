"""Decode on one GPU, beyond the dense decode row of the ``engines`` part:

- the paged decode kernels (graphcp.attention.base.DecodeKernel): each one the machine
  has (the torch reference's own; Triton's wherever Triton runs, with the kernel's own
  split of the keys, one split, and several forced; FlashInfer's and trtllm-gen's where
  flashinfer imports), on the settings' decode steps (``Settings.decode_cases``: mixed
  lengths, a request this rank holds none of, the bucket's padding rows, a page table
  wider than the longest request needs), planned with the step's live metadata and run on
  the bucket's static buffers as a decode graph does, with and without LSE: every row
  within the dtype's tolerance of the float32 torch attention, and a row with no key
  exactly output 0 and LSE -inf (graphcp.attention.reference_cases.run_decode_case);
- a speculative step: the default model with a seeded random EAGLE-3 draft, float32,
  breakable graphs with each bucket's first replay self-checked (a difference is a
  CaptureError), generating with k draft tokens a step: the tokens must be plain greedy
  decoding's, and every verify step must have run on its decode graph.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np
import torch

from graphcp.attention.backends.triton_decode import TritonDecodeAttention
from graphcp.attention.base import AttentionSpec
from graphcp.attention.reference_cases import TOLERANCE, run_decode_case
from graphcp.attention.registry import AttentionLimits, make_attention, make_decode_attention, preferred_kv_layout
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import TIME_BUDGET, fail, free_device_memory, log, skip
from graphcp.gpucheck.draft_model import ensure_random_draft
from graphcp.gpucheck.engines import engine_at_cp1, run_row
from graphcp.gpucheck.kernels import BACKEND_DTYPES, FORCED_SPLITS, decode_cases
from graphcp.gpucheck.settings import Settings
from graphcp.model.presets import ensure_preset
from graphcp.runtime.engine import PrefillEngine

#: the decode kernels by the attention backend they belong to, in the order checked
KERNELS = ("torch", "triton", "flashinfer", "trtllm")
#: Triton's key splits checked: the kernel's own choice, one, several
TRITON_SPLITS = (None, 1, FORCED_SPLITS)


def decode_kernel(name: str, splits: int | None, spec: AttentionSpec, device: torch.device,
                  limits: AttentionLimits):
    """The decode kernel of attention backend ``name`` (Triton's with ``splits``), for
    ``spec`` in the layout the backend prefers."""
    spec = dataclasses.replace(spec, kv_layout=preferred_kv_layout(name, device))
    if name == "triton":
        return TritonDecodeAttention(spec, splits)
    return make_decode_attention(make_attention(name, spec, device, limits), device, limits)


def _check_kernel(row: dict, cases: list, spec: AttentionSpec, device: torch.device, dtype: torch.dtype,
                  make: Callable) -> None:
    t0 = time.perf_counter()
    limits = AttentionLimits(max_segments=max(c.rows for c in cases), max_q_rows=max(c.rows for c in cases),
                             max_pages_per_segment=max(c.static.page_table.shape[1] for c in cases),
                             max_pages=max(c.num_pages for c in cases), dtype=dtype)
    out_err = lse_err = 0.0
    exact = True
    for case in cases:
        for with_lse in (True, False):
            kernel = make(row["kernel"], row["splits"], spec, device, limits)
            got = run_decode_case(kernel, case, with_lse)
            out_err, lse_err = max(out_err, got.out), max(lse_err, got.lse or 0.0)
            exact &= got.padding_untouched
        row["cases"] += 1
    ok = max(out_err, lse_err) <= row["tol"] and exact
    row.update(max_rel_err_out=out_err, max_rel_err_lse=lse_err, keyless_rows_exact=exact,
               status="pass" if ok else "fail", seconds=round(time.perf_counter() - t0, 3))


def check_decode_kernels(st: Settings, budget: Budget, available: list[str],
                         make: Callable = decode_kernel) -> list[dict]:
    """One row per (decode kernel, its splits, dtype, head config); see the module doc.
    ``make``: builds a kernel as :func:`decode_kernel` does (the tests pass fakes of
    FlashInfer's and trtllm's)."""
    device = torch.device(st.device)
    names = [n for n in KERNELS if n in available]
    rows: list[dict] = []
    for dtype_name in st.check_dtypes:
        dtype = getattr(torch, dtype_name)
        for hq, hkv, d in st.check_heads:
            spec = AttentionSpec(hq, hkv, d, st.page_size, d ** -0.5, "NHD")
            cases = None
            for name in names:
                for splits in TRITON_SPLITS if name == "triton" else (None,):
                    row = {"kernel": name, "splits": splits, "dtype": dtype_name, "num_q_heads": hq,
                           "num_kv_heads": hkv, "head_dim": d, "cases": 0, "tol": TOLERANCE[dtype],
                           "status": "pending", "error": None}
                    rows.append(row)
                    if dtype_name not in BACKEND_DTYPES[name]:
                        skip(row, f"{name} does not take {dtype_name}")
                        continue
                    if not budget.allows(3.0):
                        skip(row, TIME_BUDGET)
                        continue
                    where = f"decode kernel {name} splits={splits} {dtype_name} heads={hq}/{hkv}x{d}"
                    try:
                        cases = cases or decode_cases(st, spec, dtype, st.seed + d + 2)
                        _check_kernel(row, cases, spec, device, dtype, make)
                    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                        fail(row, where, e)
                        continue
                    log(f"{where}: {row['status']} out {row['max_rel_err_out']:.2e} lse "
                        f"{row['max_rel_err_lse']:.2e} ({row['seconds']} s)")
            del cases
            free_device_memory(device)
    return rows


def _speculative(engine: PrefillEngine, st: Settings, row: dict) -> None:
    rng = np.random.default_rng(st.seed + 13)
    prompts = [rng.integers(0, engine.cfg.vocab_size, n).tolist() for n in st.spec_prompts]
    plain = engine.generate(prompts, st.spec_new_tokens)
    before = len(engine.stats()["decode_steps"])
    spec = engine.generate(prompts, st.spec_new_tokens, draft_tokens=st.spec_draft_tokens)
    steps = list(engine.stats()["decode_steps"])[before:]
    verify = [s for s in steps if s.get("rows_per_request", 1) > 1]
    paths = sorted({s["path"] for s in verify})
    same = spec.tokens == plain.tokens
    row.update(batch=f"{len(prompts)} requests x {st.spec_new_tokens} new tokens, k = {st.spec_draft_tokens}",
               same_tokens_as_plain=same, verify_steps=len(verify), verify_paths=paths,
               **{k: spec.speculative[k] for k in ("acceptance_rate", "tokens_per_step", "steps", "plain_steps")})
    if not same:
        row.update(status="fail", error="speculative decoding's tokens differ from plain greedy decoding's")
    elif not verify:
        row.update(status="fail", error="no verify step ran")
    elif paths != ["graph"]:
        fallbacks = sorted({str(s.get("fallback")) for s in verify if s["path"] != "graph"})
        row.update(status="fail", error=f"a verify step ran eagerly ({', '.join(fallbacks)}): a graph was asked")
    else:
        row["status"] = "pass"


def check_speculative(st: Settings, budget: Budget, available: list[str]) -> list[dict]:
    """The speculative row (module doc): Triton's decode kernel in the verify steps' graphs
    where Triton runs, else the torch reference's."""
    device = torch.device(st.device)
    attention = st.graph_attention["breakable"] if st.graph_attention["breakable"] in available else "torch"
    row = {"engine": "default + EAGLE-3 draft, speculative", "dtype": "float32", "graph": "breakable",
           "attention": attention, "status": "pending", "error": None}
    if not budget.allows(5.0):
        return [skip(row, TIME_BUDGET)]
    target = ensure_preset("default")
    draft = ensure_random_draft(target, "default", st.seed)
    run_row(row, budget, device, lambda: engine_at_cp1(st, target, "float32", "breakable", attention, True,
                                                       draft=str(draft)), _speculative, st)
    return [row]
