"""How the whole host preparation grows: requests x CP size x tokens per request.

One rank's whole preparation (validation, KV reservation, plan, this rank's inputs,
fill of the static buffers, and the undo: ``host_stack.HostStack``) for requests in
{1, 4, 16, 64, 256} x C in {2, 8, 32, 64} x new tokens per request in {16, 512, 8192},
over a replicated and a token-sharded cache, with tiny head dimensions (the host
path is the engine's; only the tensors are small). Run:

    python -m pytest benchmarks/bench_host_scaling.py --benchmark-only --benchmark-max-time=0.02

At the end it prints the table (min and median per cell), fits each cell's median as

    t = a + e * C + b * R + c * R * 2C + d * R * L + f * R * L / C

(R requests of L tokens; R * 2C blocks; R * L / C this rank's rows) per cache mode by
least squares over the cells with <= 512 tokens a request, on the mins and on the
medians, and writes the plot (time vs requests,
one line per C, a panel per tokens per request and mode) and the figures as JSON
under ``profiles/host_scaling/``. Targets (issue 30): linear in requests and blocks;
256 requests at C = 8 in <= 400 us.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from host_stack import batch_of, host_stack

REQUESTS = (1, 4, 16, 64, 256)
CP_SIZES = (2, 8, 32, 64)
TOKENS = (16, 512, 8192)
MODES = ("replicated", "sharded")
OUT = Path(__file__).resolve().parent.parent / "profiles" / "host_scaling"

_results: list[dict] = []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("cp", CP_SIZES)
@pytest.mark.parametrize("requests", REQUESTS)
def test_whole_preparation_scaling(benchmark, requests, cp, tokens, mode):
    stack = host_stack(cp, mode == "sharded", requests, tokens)
    batch = batch_of(requests, tokens)
    benchmark.group = f"host scaling {mode}"
    benchmark.pedantic(stack.prepare_fill_abort, (batch,), rounds=_rounds(requests * tokens), warmup_rounds=5)
    st = benchmark.stats.stats
    row = {"mode": mode, "requests": requests, "cp": cp, "tokens": tokens,
           "min_us": st.min * 1e6, "median_us": st.median * 1e6}
    benchmark.extra_info.update(row)
    _results.append(row)


def _rounds(total_tokens: int) -> int:
    """Enough rounds for a stable median, few for the big batches (the machine is shared)."""
    return 1000 if total_tokens <= 1 << 14 else 100 if total_tokens <= 1 << 18 else 10


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if len(_results) == len(REQUESTS) * len(CP_SIZES) * len(TOKENS) * len(MODES):
        write_report(_results, OUT)


#: the fit's terms: what each cell's median is modelled as a sum of (us a unit)
TERMS = ("fixed", "per rank (C)", "per request (R)", "per block (R*2C)", "per token (R*L)", "per local row (R*L/C)")


def fit(rows: list[dict], key: str = "min_us") -> dict:
    """Least squares of each cell's ``key`` (min: what the neighbours' load disturbs
    least; or median) on [1, C, R, R * 2C, R * L, R * L / C] (L: tokens a request;
    R * L / C: this rank's rows), each cell weighted by 1/t so that every cell counts by
    its relative error, not the big ones alone; with the median and worst relative
    residual."""
    x = np.array([[1.0, r["cp"], r["requests"], r["requests"] * 2 * r["cp"], r["requests"] * r["tokens"],
                   r["requests"] * r["tokens"] / r["cp"]] for r in rows])
    y = np.array([r[key] for r in rows])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    res = np.abs(x @ coef - y) / y
    return {"us": dict(zip(TERMS, coef.tolist())), "median_rel_residual": float(np.median(res)),
            "max_rel_residual": float(res.max()), "cells": len(rows)}


def write_report(rows: list[dict], out: Path, load: tuple[float, ...] | None = None) -> None:
    """The table, the fits, the JSON and the plot of one run (``load``: the machine's
    load average at the run; now by default)."""
    out.mkdir(parents=True, exist_ok=True)
    load = tuple(load) if load is not None else os.getloadavg()
    # fitted on the cells up to 512 tokens a request: at 8192 (up to 2M tokens, a rank's
    # rows tens of MB) memory traffic bends the token terms; those cells are in the table
    fits = {f"{m}, {k[:-3]}": fit([r for r in rows if r["mode"] == m and r["tokens"] <= 512], k)
            for m in MODES for k in ("min_us", "median_us")}
    lines = [f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
             "mode        tokens  C  " + "".join(f"{'R=' + str(r):>18}" for r in REQUESTS)]
    for m in MODES:
        for t in TOKENS:
            for c in CP_SIZES:
                cells = {r["requests"]: r for r in rows if (r["mode"], r["tokens"], r["cp"]) == (m, t, c)}
                lines.append(f"{m:11s} {t:6d} {c:2d}  " + "".join(
                    f"{cells[n]['min_us']:8.0f}/{cells[n]['median_us']:<9.0f}" for n in REQUESTS))
    for m, f in fits.items():
        terms = " + ".join(f"{v:.4g} us {k}" for k, v in f["us"].items())
        lines.append(f"fit {m} ({f['cells']} cells, <= 512 tokens a request): {terms}; residual median "
                     f"{100 * f['median_rel_residual']:.1f}%, worst {100 * f['max_rel_residual']:.0f}%")
    text = "\n".join(lines)
    print("\n" + text)
    (out / "table.txt").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"load": load, "rows": rows, "fits": fits,
                                                  "commit": _commit()}, indent=1) + "\n")
    _plot(rows, out / "host_scaling.png")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(MODES), len(TOKENS), figsize=(13, 7), sharex=True, squeeze=False)
    for i, m in enumerate(MODES):
        for k, t in enumerate(TOKENS):
            ax = axes[i][k]
            for c in CP_SIZES:
                pts = sorted((r["requests"], r["median_us"]) for r in rows
                             if (r["mode"], r["tokens"], r["cp"]) == (m, t, c))
                ax.plot(*zip(*pts), marker="o", label=f"C = {c}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{m}, {t} tokens/request", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if k == 0:
                ax.set_ylabel("whole preparation, median (us)")
            if i == len(MODES) - 1:
                ax.set_xlabel("requests")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("graphcp host preparation per forward (one rank): validation, KV reservation, plan, fill, undo")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
