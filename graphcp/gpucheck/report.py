"""One JSON report and one Markdown summary of a GPU-check run, and what makes it fail."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from graphcp.gpucheck.coverage import MULTI_GPU

SCHEMA_VERSION = 3
JSON_NAME, MD_NAME = "gpu_check.json", "gpu_check.md"
#: why a row did not run when the budget ran out: the run then fails (a required row did not run)
TIME_BUDGET = "time budget"
#: a row's statuses that make the run fail; ``fallback``: a graph path that ran eagerly
BAD = ("fail", "error", "fallback")


def _fmt(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else format(x, spec)
    return str(x)


def _mib(b: Any) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _short(s: Any, n: int = 110) -> str:
    s = "" if s is None else str(s)
    return s if len(s) <= n else s[: n - 3] + "..."


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in r) + " |" for r in rows]
    return lines + [""]


def _status(r: dict, ok: tuple[str, ...] = ("ok", "pass"), n: int = 60) -> str:
    return r["status"] + (f": {_short(r.get('error'), n)}" if r["status"] not in ok else "")


def _checked_rows(res: dict):
    """(part, label, row) of every checked row of the report."""
    for c in res["backends"]["checks"]:
        yield "kernels", f"{c['backend']} {c['dtype']} {c['num_q_heads']}/{c['num_kv_heads']}x{c['head_dim']}", c
    for r in res.get("sparse_mla", []):
        yield "sparse_mla", f"{r['dtype']} {r.get('rows')} rows", r
    for g in res.get("graphs", []):
        yield "graphs", f"{g['dtype']} {g['graph']}", g
    for r in res.get("engines", []):
        yield "engines", f"{r['engine']} {r['dtype']} {r['graph']}", r
    for r in res.get("hybrid", []):
        yield "hybrid", f"{r['engine']} {r['dtype']} {r['graph']}", r
    for r in res.get("host", []):
        yield "host", r["case"], r
    for r in res.get("timing", []):
        yield "timing", f"{r['model']} {r['backend']} {r['path']} {r['tokens']}", r
    for r in res.get("launches", []):
        yield "launches", f"{r['model']} {r['backend']} {r['path']}", r
    for r in res.get("moe_graph", []):
        yield "moe_graph", f"{r['dtype']} {r['graph_backend']}", r


def failures(res: dict) -> list[str]:
    """``"part: what"`` for every part that raised or did not run, every checked row that
    failed, errored or ran eagerly where a graph was asked, and every row the budget left
    out: the command exits non-zero when there is any. (Rows skipped because the machine
    cannot run them, a backend that takes no such dtype, say, do not count; nor a Triton
    warm-up the budget cut short: the checks after it compile what it did not.)"""
    out = [f"{p}: raised (see errors)" for p in res.get("failed_parts", [])]
    out += [f"{p}: did not run ({why})" for p, why in res.get("not_run", [])]
    w = res.get("triton_warmup") or {}
    status = str(w.get("status", "ok"))
    if status.startswith("error"):  # cut short by the budget is no failure: the checks after it compile
        out.append(f"warmup: {status}")
    for part, label, r in _checked_rows(res):
        if r.get("status") in BAD:
            why = f" ({_short(r.get('error'), 80)})" if r.get("error") else ""
            out.append(f"{part}: {label} {r['status']}{why}")
        elif r.get("status") == "skipped" and r.get("error") == TIME_BUDGET:
            out.append(f"{part}: {label} did not run ({TIME_BUDGET})")
    return out


# ---- the Markdown, a section a function ------------------------------------------------------
def _head(res: dict) -> list[str]:
    env, dev = res["env"], res["device"]
    out = [f"# graphcp GPU check{' (dry run, CPU)' if res['dry_run'] else ''}", "",
           f"{dev['name']} (capability {dev.get('capability') or '-'}), torch {env['torch']}, "
           f"triton {env.get('triton') or '-'}, flashinfer {env.get('flashinfer') or '-'}, "
           f"CUDA {env.get('cuda') or '-'}, nvtx {'yes' if env.get('nvtx') else 'no'}, host kernels "
           f"{'compiled (numba)' if env.get('host_kernels_compiled') else 'numpy twins and Python (no numba)'}; "
           f"{res['elapsed_s']:.0f} s of a {res['budget_s']:.0f} s budget; {res['started_at']}", ""]
    skipped = res.get("options", {}).get("skip") or ()
    verdict = (f"**FAILED**: {len(res['failures'])} check(s) failed, errored or did not run (section Failed)"
               if res.get("failures") else "**Passed**: every part run passed"
               + (f" (left out on request: {', '.join(skipped)})" if skipped else " (every part ran)"))
    out += [verdict, ""] if "failures" in res else []
    out += [f"- {n}" for n in res.get("notes", [])] + ([""] if res.get("notes") else [])
    out += ["## Parts (seconds used of the share)", ""]
    return out + _table(["part", "share s", "used s"], [[k, _fmt(v, ".0f"), _fmt(res["phases"]["used"].get(k), ".1f")]
                                                       for k, v in res["phases"]["shares"].items()])


def _warmup(res: dict) -> list[str]:
    w = res.get("triton_warmup")
    if not w:
        return []
    out = ["## Triton warm-up", "", f"{w['launched']}/{w['variants']} variants launched, "
           f"{w['compiles'] if w['compiles'] is not None else 'no (interpreter)'} compiles, {w['seconds']} s; "
           f"status {w['status']}.", ""]
    if w.get("kernels"):
        out += _table(["variant", "registers", "spills", "warps", "stages", "shared B"],
                      [[str(i), _fmt(k["n_regs"]), _fmt(k["n_spills"]), _fmt(k["num_warps"]), _fmt(k["num_stages"]),
                        _fmt(k["shared_bytes"])] for i, k in enumerate(w["kernels"])])
    return out


def _kernels(res: dict) -> list[str]:
    checks = res["backends"]["checks"]
    if not checks:
        return []
    out = [f"## Attention kernels vs the torch reference ({', '.join(res['backends']['checked'])})", "",
           "max |x - ref| / max |ref| over zigzag plans with prefixes and empty segments (LSE, base e: "
           "/ max(|ref|, 1)); padding rows must keep their sentinel.", ""]
    return out + _table(
        ["backend", "dtype", "heads q/kv", "head_dim", "plans", "out err", "out err (no lse)", "lse err",
         "padding untouched", "tol", "status"],
        [[c["backend"], c["dtype"], f"{c['num_q_heads']}/{c['num_kv_heads']}", str(c["head_dim"]), str(c["plans"]),
          _fmt(c["max_rel_err_out"], ".2e"), _fmt(c["max_rel_err_out_nolse"], ".2e"), _fmt(c["max_rel_err_lse"], ".2e"),
          _fmt(c["padding_untouched"]), _fmt(c["tol"], ".0e"), _status(c, ("pass",))] for c in checks])


def _graphs(res: dict) -> list[str]:
    if not res["graphs"]:
        return []
    out = ["## Graph replay vs the same-bucket eager body (CP = 1, default model)", "",
           "bitwise: replay output rows equal the same body run eagerly on the same bucket and buffers; "
           "rel diff: vs the unpadded eager body; a batch that ran eagerly fails.", ""]
    rows = [[g["dtype"], g["graph"], g["attention"], g["graph_backend"], _fmt(g.get("self_check")),
             _fmt(b.get("batch")), _fmt(b.get("bucket")), _fmt(b.get("bitwise_equal")),
             _fmt(b.get("max_abs_diff"), ".1e"), _fmt(b.get("rel_diff_vs_unpadded_eager"), ".1e"),
             _status(b if b else g, ("pass",))] for g in res["graphs"] for b in g["batches"] or [{}]]
    return out + _table(["dtype", "graph", "attention", "backend", "capture self-check", "batch", "bucket",
                         "bitwise", "max abs diff", "rel diff", "status"], rows)


def _engines(res: dict) -> list[str]:
    if not res.get("engines"):
        return []
    out = ["## Engines at CP = 1 (DeepSeek V4, MoE tp and ep, an EAGLE-3 draft's graphs, decode)", "",
           "bitwise: the replay (the draft's, for the draft; decode: each bucket's first, self-checked) equals the "
           "same bucket run eagerly; logits: the graph path vs the eager path (relative, within tol); experts in "
           "break: the tp layout's experts held out of the graphs.", ""]
    rows = [[r["engine"], r["dtype"], r["graph"], _fmt((r.get("batches") or [{}])[0].get("bitwise_equal")),
             _fmt(r.get("segments_breaks")), _fmt(r.get("experts_in_break")), _fmt(r.get("ran")),
             _fmt(r.get("logits_rel_diff_vs_eager"), ".1e"), _fmt(r.get("tol"), ".0e"), _status(r, ("pass",))]
            for r in res["engines"]]
    return out + _table(["engine", "dtype", "graph", "bitwise", "segments, breaks", "experts in break", "ran",
                         "logits rel diff", "tol", "status"], rows)


def _hybrid(res: dict) -> list[str]:
    if not res.get("hybrid"):
        return []
    out = ["## Linear-attention hybrid at CP = 1", "",
           "bitwise: the replay equals the same bucket run eagerly; graph vs eager: the prefill's logits; kernels: the "
           "linear layers' (fla-core, causal-conv1d, or torch); varlen: one long request beside short ones, eager: "
           "float32 against the torch kernels, bfloat16's distance from float32 against the torch kernels' "
           "(x1.25).", ""]
    rows = [[r["dtype"], _fmt((r.get("batches") or [{}])[0].get("bitwise_equal")), _fmt(r.get("segments_breaks")),
             _fmt(r.get("ran")), _fmt(r.get("logits_rel_diff_vs_eager"), ".1e"), _fmt(r.get("linear_kernels")),
             _fmt(r.get("varlen_batch")), _fmt(r.get("kernels_rel_diff_vs_torch"), ".1e"),
             _fmt(r.get("kernels_rel_diff_vs_float32"), ".1e"), _fmt(r.get("torch_rel_diff_vs_float32"), ".1e"),
             _fmt(r.get("kernels_bound"), ".1e"), _status(r, ("pass",))] for r in res["hybrid"]]
    return out + _table(["dtype", "bitwise", "segments, breaks", "ran", "graph vs eager", "kernels", "varlen batch",
                         "vs torch kernels", "vs float32", "torch vs float32", "kernels bound", "status"], rows)


def _captures(res: dict) -> list[str]:
    if not res["captures"]:
        return []
    return ["## Capture (per bucket)", ""] + _table(
        ["model", "attention", "graph", "bucket", "capture s", "pool MiB", "segments", "breaks"],
        [[c["model"], c["backend"], c["graph"], str(c["capacity"]), _fmt(c["capture_s"], ".2f"),
          _mib(c["pool_bytes"]), str(c["segments"]), str(c["breaks"])] for c in res["captures"]])


def _host(res: dict) -> list[str]:
    if not res.get("host"):
        return []
    out = ["## Host preparation (one rank, before a replay; a measurement)", "",
           "validation, KV reservation, plan, this rank's inputs, fill of the static buffers and the undo; "
           "the ledger's target is a median of 50 us (docs/performance.md).", ""]
    return out + _table(["case", "CP, rank", "tokens", "host kernels", "median us", "min us", "vs target", "status"],
                        [[r["case"], f"{r['cp']}, {r['rank']}", _fmt(r.get("tokens")), r["host_kernels"],
                          _fmt(r.get("median_us"), ".1f"), _fmt(r.get("min_us"), ".1f"),
                          _fmt(r.get("vs_target"), ".2f") + ("x" if r.get("vs_target") is not None else ""),
                          _status(r)] for r in res["host"]])


def _launches(res: dict) -> list[str]:
    if not res["launches"]:
        return []
    out = ["## Launches per forward", "",
           "kernels: device kernels in one forward (torch.profiler, CUDA graph kernels included); launch calls: "
           "kernel-launch API calls on the host; host ops: torch ops dispatched on the host; ranges: graphcp "
           "ranges in the trace (the NVTX names; trace file next to this report).", ""]
    return out + _table(
        ["model", "attention", "path", "tokens", "kernels", "launch calls", "graph launches", "host ops",
         "segments + breaks", "ranges", "trace", "status"],
        [[r["model"], r["backend"], r["path"], str(r["tokens"]), _fmt(r.get("kernels")),
          _fmt(r.get("kernel_launch_calls")), _fmt(r.get("graph_launches")), _fmt(r.get("host_ops")),
          f"{r['segments']} + {r['breaks']}" if "segments" in r else "-",
          _short(", ".join(f"{k} {v}" for k, v in (r.get("ranges") or {}).items()), 90) or "-",
          _fmt(r.get("trace")), _status(r)] for r in res["launches"]])


def _sparse(res: dict) -> list[str]:
    if not res.get("sparse_mla"):
        return []
    out = ["## Sparse MLA kernel at long row counts (DSA)", "",
           "The Triton kernel over every row; the first and last rows against the absorbed attention in "
           "float32 (||x - ref|| / ||ref||); past int32: q_lat has >= 2**31 elements.", ""]
    return out + _table(
        ["dtype", "rows", "heads", "latent", "topk", "past int32", "rows checked", "last row", "rel err", "tol",
         "kernel ms", "status"],
        [[r["dtype"], _fmt(r.get("rows")), _fmt(r.get("heads")), f"{r.get('kv_lora_rank')}+{r.get('rope_dim')}",
          _fmt(r.get("topk")), _fmt(r.get("past_int32")), _fmt(r.get("checked_rows")),
          _fmt(r.get("last_row_checked")), _fmt(r.get("max_rel_err"), ".2e"), _fmt(r.get("tol"), ".0e"),
          _fmt(r.get("kernel_ms"), ".1f"), _status(r, ("pass",))] for r in res["sparse_mla"]])


def _moe_graph(res: dict) -> list[str]:
    if not res.get("moe_graph"):
        return []
    out = ["## MoE layer captured, replayed with changing routing (moe='tp', grouped matmuls)", "",
           "bitwise: each replay equals the layer run eagerly on the same input; rel err: vs the per-expert "
           "loop in float32 (pytorch issue 169970: a replay's illegal memory access would end the run here).", ""]
    return out + _table(
        ["dtype", "backend", "rows", "experts", "top-k", "replays", "routing changed", "bitwise", "max abs diff",
         "rel err", "tol", "status"],
        [[r["dtype"], r["graph_backend"], _fmt(r.get("rows")), _fmt(r.get("experts")), _fmt(r.get("top_k")),
          _fmt(r.get("replays")), _fmt(r.get("routing_changed")), _fmt(r.get("bitwise_equal")),
          _fmt(r.get("max_abs_diff_vs_eager"), ".1e"), _fmt(r.get("max_rel_err_vs_loop"), ".2e"),
          _fmt(r.get("tol"), ".0e"), _status(r, ("pass",))] for r in res["moe_graph"]])


def _coverage(res: dict) -> list[str]:
    out = ["## Not covered on one GPU", "",
           "Every multi-rank path needs one GPU a rank (NCCL refuses two ranks on one GPU), so this check does not "
           "run them. On a machine with that many GPUs, each command below checks one (it exits 1 on a "
           "difference from the eager forward):", ""]
    return out + _table(["what", "GPUs", "command"], [[what, str(n), f"`{cmd}`"] for what, n, cmd in MULTI_GPU])


def _problems(res: dict) -> list[str]:
    out = []
    if res.get("failures"):
        out += ["## Failed", ""] + [f"- {f}" for f in res["failures"]] + [""]
    problems = [(part, label, r["status"], r.get("error")) for part, label, r in _checked_rows(res)
                if r.get("status") in BAD]
    problems += [("run", "", "error", e) for e in res.get("errors", [])]
    if problems:
        out += ["## Errors", ""]
        out += _table(["where", "what", "status", "message"], [[a, b, c, _short(d, 160)] for a, b, c, d in problems])
    return out


def _timing(res: dict) -> list[str]:
    if not res["timing"]:
        return []
    eager = {(r["model"], r["backend"], r["tokens"]): r.get("median_ms") for r in res["timing"]
             if r["path"] == "eager" and r["status"] == "ok"}
    out = [f"## Prefill time, CP = 1, one request ({res['settings']['timing_dtype']}; "
           f"median of up to {res['settings']['repeats']} after warm-up; TTFT proxy)", "",
           "logits rel diff: a graph path's last logits vs the eager path's, within tol or the row fails.", ""]
    rows = []
    for r in res["timing"]:
        e, ms = eager.get((r["model"], r["backend"], r["tokens"])), r.get("median_ms")
        speed = f"{e / ms:.2f}x" if e and ms and r["path"] != "eager" else "-"
        rows.append([r["model"], r["backend"], str(r["tokens"]), r["path"], _fmt(ms, ".2f"),
                     _fmt(r.get("min_ms"), ".2f"), _fmt(r.get("repeats")), _fmt(r.get("tokens_per_s"), ".3g"), speed,
                     _fmt(r.get("bucket")), _fmt(r.get("logits_rel_diff_vs_eager"), ".1e"), _fmt(r.get("tol"), ".0e"),
                     _mib(r.get("peak_mem_bytes")), _status(r, ("ok",), 50)])
    return out + _table(["model", "attention", "tokens", "path", "prefill ms", "min ms", "n", "tokens/s", "vs eager",
                         "bucket", "logits rel diff", "tol", "peak MiB", "status"], rows)


SECTIONS = (_head, _warmup, _kernels, _graphs, _engines, _hybrid, _captures, _host, _launches, _sparse, _moe_graph,
            _coverage, _problems, _timing)


def render_markdown(res: dict) -> str:
    """The summary: the verdict first, the prefill times last."""
    return "\n".join(line for section in SECTIONS for line in section(res)).rstrip() + "\n"


def write_report(res: dict, out_dir: Path) -> str:
    """Write ``gpu_check.json`` and ``gpu_check.md`` into ``out_dir``; return the markdown."""
    md = render_markdown(res)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (JSON_NAME + ".tmp")
    tmp.write_text(json.dumps(res, indent=2, default=str) + "\n")
    tmp.replace(out_dir / JSON_NAME)
    (out_dir / MD_NAME).write_text(md)
    return md
