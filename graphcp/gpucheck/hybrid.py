"""The linear-attention hybrid (``default-hybrid``, Qwen3.5-style: Gated DeltaNet layers
and full-attention layers) at CP 1, its linear layers on the kernels the machine has:
fla-core's rule and causal-conv1d's convolution where they import, else the torch
reference (each row's ``linear_kernels`` says which ran; a float32 model runs the torch
rule by design, graphcp/model/hybrid/kernels.py).

Its full-attention layers attend with the torch reference: the Triton kernel is the
``kernels`` and ``graphs`` parts' (and the varlen batch's request count would compile a
variant the warm-up does not). One row a dtype (float32, then bfloat16), each:

- the engines' check (:mod:`graphcp.gpucheck.engines`): a bucket captured with the
  self-check on (a linear layer is a break), a batch extending a cached prefix replayed
  bitwise equal to the same bucket's eager body, the prefill on the graph and its logits
  within the bound of the eager path's;
- a varlen batch, one long request beside short ones (``Settings.hybrid_batch``: the
  blocks the kernels get as one batch), every token's logits, eager. The float32 row's
  are the reference. A row whose kernels are not the torch ones runs the batch through
  the torch kernels too: float32 within :data:`RUN_TOLERANCE` of them; the timing dtype no
  further from the float32 reference than the torch kernels in that dtype (x
  :data:`KERNEL_SLACK`: both round to bfloat16, each its own way). On the torch kernels
  alone the distances are reported: bfloat16 is ~5e-2 from float32 on this model, and
  transformers' bfloat16 as far from its float32.

Then decode (the timing dtype): a few steps of a batch on the decode graphs, each bucket's
first replay self-checked (the linear layers' steps inside the graph), and eagerly
(:func:`graphcp.gpucheck.engines.check_decode`); where the step's kernels are not the torch
ones (fla's fused recurrent rule, causal-conv1d's update: ``step_kernels``), the eager steps
again on the torch step kernels, within :data:`RUN_TOLERANCE` of them.
"""

from __future__ import annotations

import numpy as np
import torch

from graphcp.config import RuntimeConfig
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.engines import DECODE_STEPS, check_decode, check_model, decode_steps, run_row
from graphcp.gpucheck.settings import Settings
from graphcp.jobs.tolerance import RUN_TOLERANCE
from graphcp.model.hybrid import kernels as linear_kernels
from graphcp.model.hybrid.exchange import HybridExchange
from graphcp.model.hybrid.step_kernels import TORCH_STEP
from graphcp.model.presets import ensure_preset
from graphcp.runtime.batch import Request
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import PrefillEngine

PRESET = "default-hybrid"
#: how much further from float32 a library's bfloat16 may be than the torch kernels' (the CPU
#: tests' rule, tests/test_hybrid_kernels.py)
KERNEL_SLACK = 1.25


def _engine(st: Settings, dtype: str) -> PrefillEngine:
    rows = sum(st.hybrid_batch) + sum(st.engine_batch)
    rt = RuntimeConfig(device=st.device, dtype=dtype, graph="breakable", attention="torch",
                       page_size=st.page_size, kv_tokens=rows + 16 * st.page_size, graph_backend=st.graph_backend,
                       max_requests=max(len(st.hybrid_batch), 4), verify_capture=True)
    return PrefillEngine(ensure_preset(PRESET), rt, None, BucketSet((st.engine_bucket,), padding_factor=64.0))


def _exchange(engine: PrefillEngine) -> HybridExchange:
    ex = engine.parts.exchange
    if not isinstance(ex, HybridExchange):
        raise TypeError(f"{PRESET}'s exchange is {type(ex).__name__}, expected a HybridExchange")
    return ex


def _varlen(engine: PrefillEngine, st: Settings) -> tuple[torch.Tensor, str]:
    """The varlen batch, eager: every token's logits (float32, host) and the kernels that ran."""
    rng = np.random.default_rng(st.seed + 13)
    batch = [Request(rng.integers(0, engine.cfg.vocab_size, n)) for n in st.hybrid_batch]
    out = engine.prefill(batch, all_logits=True, force_eager=True)
    for h in out.handles:
        engine.release(h)
    return torch.cat([x.float().cpu() for x in out.logits]), out.info.stats["linear_kernels"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def _judge_kernels(engine: PrefillEngine, st: Settings, row: dict, reference: dict) -> None:
    """The varlen batch on this engine's kernels and, where they are not the torch ones,
    on the torch kernels (module doc); the float32 row's logits become ``reference``'s."""
    dtype = row["dtype"]
    got, row["linear_kernels"] = _varlen(engine, st)
    row["varlen_batch"] = f"{st.hybrid_batch[0]} + {len(st.hybrid_batch) - 1} x {st.hybrid_batch[-1]} tokens"
    ex = _exchange(engine)
    chosen, ex.kernels = ex.kernels, linear_kernels.TORCH
    try:
        want = got if row["linear_kernels"] == "torch" else _varlen(engine, st)[0]
    finally:
        ex.kernels = chosen
    if dtype == "float32":
        reference["float32"] = got
        diff, bound = _rel(got, want), RUN_TOLERANCE[dtype]
        row.update(kernels_rel_diff_vs_torch=diff, kernels_bound=bound)
        why = f"{row['linear_kernels']} differs from the torch kernels by {diff:.3g} (bound {bound:g})"
    elif "float32" not in reference:
        row["kernels_error"] = "no float32 reference (its row did not run)"
        return
    else:  # bfloat16 is ~5e-2 from float32 on this model, transformers' too: the torch kernels' distance is the bound
        ref = reference["float32"]
        torch_diff, diff = _rel(want, ref), _rel(got, ref)
        bound = KERNEL_SLACK * torch_diff
        row.update(torch_rel_diff_vs_float32=torch_diff, kernels_rel_diff_vs_float32=diff, kernels_bound=bound)
        why = (f"{row['linear_kernels']} is {diff:.3g} from float32, more than {KERNEL_SLACK:g} x the torch "
               f"kernels' {torch_diff:.3g}")
    if diff > bound and row["status"] == "pass":
        row.update(status="fail", error=why)


def _check_decode(engine: PrefillEngine, st: Settings, row: dict) -> None:
    """The decode row (module doc): the graph and eager steps, then the step kernels
    against the torch ones."""
    check_decode(engine, st, row)
    ex = _exchange(engine)
    row["step_kernels"] = ex.decode.kernels.name
    if row["step_kernels"] == "torch":
        return
    rng = np.random.default_rng(st.seed + 17)
    toks = tuple(rng.integers(0, engine.cfg.vocab_size, n) for n in st.hybrid_batch[1:4])
    tokens = rng.integers(0, engine.cfg.vocab_size, (DECODE_STEPS, len(toks)))
    got = torch.cat(decode_steps(engine, toks, tokens, True)[0])
    chosen, ex.decode.kernels = ex.decode.kernels, TORCH_STEP
    try:
        want = torch.cat(decode_steps(engine, toks, tokens, True)[0])
    finally:
        ex.decode.kernels = chosen
    diff, bound = _rel(got.float(), want.float()), RUN_TOLERANCE[row["dtype"]]
    row.update(step_kernels_rel_diff_vs_torch=diff, step_kernels_bound=bound)
    if diff > bound and row["status"] == "pass":
        row.update(status="fail", error=f"{row['step_kernels']} steps differ from the torch step kernels' by "
                                        f"{diff:.3g} (bound {bound:g})")


def check_hybrid(st: Settings, budget: Budget) -> list[dict]:
    """One row a dtype of ``st.hybrid_dtypes`` (float32 first: the reference), then the
    decode row (the timing dtype)."""
    device = torch.device(st.device)
    rows: list[dict] = []
    reference: dict[str, torch.Tensor] = {}
    for dtype in st.hybrid_dtypes:
        row = {"engine": PRESET, "dtype": dtype, "graph": "breakable", "status": "pending", "batches": []}
        rows.append(row)

        def check(engine: PrefillEngine, st: Settings, row: dict) -> None:
            check_model(engine, st, row)
            _judge_kernels(engine, st, row, reference)

        run_row(row, budget, device, lambda d=dtype: _engine(st, d), check, st)
    row = {"engine": f"{PRESET} decode", "dtype": st.timing_dtype, "graph": "breakable", "status": "pending",
           "batches": []}
    rows.append(row)
    run_row(row, budget, device, lambda: _engine(st, st.timing_dtype), _check_decode, st)
    return rows
