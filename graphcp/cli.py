"""The ``graphcp`` command: run, prefill, tune, profile.

Exit codes: 0 done; 2 bad input (one ``graphcp CMD: error: ...`` line on stderr,
nothing written or changed); 1 a failed run (one line) or a bug (a traceback).
``--debug`` or ``GRAPHCP_DEBUG=1`` adds tracebacks (each failing rank's too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


class _Parser(argparse.ArgumentParser):
    """Usage errors follow the error contract too: one line, exit code 2 (subcommand
    parsers inherit this class)."""

    def error(self, message: str):
        from graphcp.errors import one_line

        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def _add_runtime_args(p: argparse.ArgumentParser, default_graph: str | None) -> None:
    p.add_argument("--model", default="default", help="checkpoint folder or preset name (default: the built-in preset)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (= TP ranks of the MLP)")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "interleave"])
    p.add_argument("--graph", default=default_graph, choices=["off", "breakable", "full"],
                   help="graph mode (default: breakable where supported, i.e. the zigzag layout)")
    p.add_argument("--graph-backend", default="auto", choices=["auto", "cuda", "trace"])
    p.add_argument("--attention", default="torch", choices=["torch", "triton", "flashinfer", "trtllm", "auto"])
    p.add_argument("--buckets", default=None, help="bucket file written by `graphcp tune`")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--max-requests", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--verify-capture", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each new bucket on a synthetic batch and compare it bitwise with the same-bucket "
                        "eager body (default: on for the trace graph backend, off for cuda; on for `graphcp run`)")


def _spec(args):
    from graphcp.config import RuntimeConfig
    from graphcp.jobs import JobSpec

    graph = args.graph or ("breakable" if args.layout == "zigzag" else "off")
    rt = RuntimeConfig(
        dtype=args.dtype, device=args.device, page_size=args.page_size, kv_tokens=args.kv_tokens,
        attention=args.attention, graph=graph, graph_backend=args.graph_backend, layout=args.layout,
        max_requests=args.max_requests, collective_timeout_s=args.timeout, verify_capture=args.verify_capture,
    )
    return JobSpec(args.model, rt, args.buckets, args.cp)


def _preflight(spec) -> None:
    """What can be refused before ranks start, in this process: the parallel config, the
    model's config.json against it, and the bucket file (each rank would fail the same
    way, only later and N times)."""
    from graphcp.config import ModelConfig, ParallelConfig
    from graphcp.model.presets import resolve_model

    parallel = ParallelConfig(cp_size=spec.cp_size)
    parallel.check_model(ModelConfig.from_file(resolve_model(spec.model) / "config.json"))
    spec.buckets()


def _save(obj, path: str) -> None:
    """torch.save through a temporary file: an old OUT.pt is replaced whole or not at all."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cmd_prefill(args) -> int:
    from graphcp.checks import check_output_path
    from graphcp.jobs import prefill_job, run_ranks
    from graphcp.requests_io import parse_requests

    check_output_path(args.output, "--output")  # before any work: not after the forward
    spec = _spec(args)
    reqs = parse_requests(args.input)
    _preflight(spec)
    res = run_ranks(prefill_job, spec, reqs, args.all_logits)
    if res is not None:
        out = {"last_logits": res["last_logits"]}
        if args.all_logits:
            out["logits"] = res["logits"]
        _save(out, args.output)
        info = res["info"]
        print(f"prefilled {len(reqs)} requests on {info['cp_size']} rank(s), layout {info['layout']}, "
              f"path {info['path']} (local capacity {info['capacity']}) -> {args.output}")
    return 0


#: graph vs the unpadded eager forward: rounding of matmuls over padded rows only
RUN_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def cmd_run(args) -> int:
    from graphcp.checks import check_output_path
    from graphcp.jobs import run_job, run_ranks

    if args.verify_capture is None:
        args.verify_capture = True  # the main job shows the self-check whatever the backend
    if args.json:
        check_output_path(args.json, "--json")
    spec = _spec(args)
    _preflight(spec)
    res = run_ranks(run_job, spec)
    rows = [
        ("model", res["model"]),
        ("ranks (CP = TP)", res["cp_size"]),
        ("layout / graph / attention", f"{res['layout']} / {res['graph']} / {res['attention']}"),
        ("batch", f"{res['requests']} requests, {res['tokens']} tokens"),
        ("buckets captured", ", ".join(map(str, res["buckets"])) or "-"),
        ("capture time", f"{res['capture_s']:.2f} s" + (f" (of which {res['verify_s']:.2f} s self-check)"
                                                         if res["verify_s"] else "")),
        ("eager forward", f"{res['eager_s'] * 1e3:.1f} ms: {res['ops_eager']} ops dispatched"),
    ]
    if "graph_s" in res:
        rows += [
            ("graph forward", f"{res['graph_s'] * 1e3:.1f} ms ({res['graph_path']}, bucket {res['bucket']}): "
                              f"{res['graph_segments']} graph launches + {res['graph_breaks']} breaks, "
                              f"{res['ops_graph']} host ops (breaks, fill, LM head)"),
            ("KV received per layer", f"{res['kv_bytes_per_layer'] / 2**20:.2f} MiB a rank (all-gather of the bucket)"),
        ]
        for c in res["comparisons"]:
            same = {True: "bitwise equal", False: "DIFFERS", None: "no graph"}[c["same_bucket_bitwise"]]
            rows.append((f"graph vs eager ({c['dtype']})",
                         f"same bucket: {same}; unpadded: max |diff| {c['max_abs_diff']:.3g}, "
                         f"relative {c['rel_diff']:.3g} (bucket {c['bucket']})"))
    w = max(len(k) for k, _ in rows)
    print("| " + "what".ljust(w) + " | value |")
    print("|-" + "-" * w + "-|-------|")
    for k, v in rows:
        print(f"| {k.ljust(w)} | {v} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
    for c in res.get("comparisons", []):
        # the replay must equal the same-bucket body exactly; the unpadded forward only
        # within the rounding of matmuls over padded rows
        bound = RUN_TOLERANCE[c["dtype"]]
        if c["same_bucket_bitwise"] is False or not c["rel_diff"] <= bound:
            print(f"graph output differs from eager in {c['dtype']} (same bucket bitwise: {c['same_bucket_bitwise']}, "
                  f"relative {c['rel_diff']:.3g}, expected <= {bound:g})", file=sys.stderr)
            return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="graphcp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", default=False,
                        help="print tracebacks of graphcp's errors (also GRAPHCP_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prefill", help="prefill the requests of a JSONL file and save the logits")
    p.add_argument("--input", required=True, help='REQUESTS.jsonl: {"tokens": [...], "prefix": K} a line')
    p.add_argument("--output", required=True, help="OUT.pt (torch.save dict)")
    p.add_argument("--all-logits", action="store_true", help="also save every new token's logits")
    _add_runtime_args(p, None)
    p.set_defaults(func=cmd_prefill)

    p = sub.add_parser("run", help="the main job on the built-in default model: capture, replay, compare")
    _add_runtime_args(p, "breakable")
    p.set_defaults(cp=2)
    p.add_argument("--json", default=None, help="also write the results as JSON")
    p.set_defaults(func=cmd_run)

    try:
        from graphcp.tune.cli import add_tune_parser

        add_tune_parser(sub)
    except ImportError:  # pragma: no cover - the tune package ships with graphcp
        pass
    try:
        from graphcp.profile_cli import add_profile_parser

        add_profile_parser(sub)
    except ImportError:
        pass
    for p in sub.choices.values():  # --debug after the command too; SUPPRESS keeps the top-level value
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line. graphcp's own errors become one stderr line and exit code 2
    (bad input) or 1 (a failed run); anything else is a bug and surfaces as one."""
    from graphcp.errors import report

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Exception as e:  # noqa: BLE001 - graphcp's errors are reported, the rest re-raised
        code = report(f"graphcp {args.command}", e, args.debug)
        if code is None:
            raise
        return code
