"""The ``graphcp`` command: ``run`` (the main job on the built-in model), ``prefill``
(a request file, logits saved), ``generate`` (greedy generation and conversations),
``tune`` (bucket capacities for a workload), ``profile`` (per-rank traces and a range
summary), ``pd-demo`` (a prefill/decode round trip)
and ``gpu-check`` (the one-shot GPU check). ``graphcp CMD --help`` for each.

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

from graphcp.checks import check_output_dir, check_output_path
from graphcp.cli.generate import add_generate_parser
from graphcp.cli.jobs import mixed_batch, prefill_job, run_job, twin_dtype
from graphcp.cli.pd_demo import add_pd_demo_parser
from graphcp.cli.requests import check_request_vocabulary, parse_requests
from graphcp.cli.table import print_table, ranks_text
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings
from graphcp.errors import one_line, report
from graphcp.gpucheck.cli import add_gpu_check_parser
from graphcp.jobs.args import add_draft_arg, add_runtime_args, help_text, interpret_triton_on_cpu, job_spec, preflight
from graphcp.jobs.memory import check_local_ranks_fit, job_memory
from graphcp.jobs.spec import run_job_on_ranks
from graphcp.jobs.tolerance import RUN_TOLERANCE
from graphcp.model.family import family_of
from graphcp.profile.cli import add_profile_parser
from graphcp.runtime.stats import write_stats
from graphcp.tune.cli import add_tune_parser


class _Parser(argparse.ArgumentParser):
    """Usage errors follow the error contract too: one line, exit code 2 (subcommand
    parsers inherit this class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """An unknown flag is reported by the command it was given to (``graphcp prefill:
        error: unrecognized arguments: ...``): argparse leaves the leftovers of a
        subcommand to the top-level parser, which would say ``graphcp: error:``."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = getattr(self, "commands", {})
            commands.get(getattr(ns, "command", None), self).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


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
    check_output_path(args.output, "--output")  # before any work: not after the forward
    if args.stats:
        check_output_path(args.stats, "--stats")
    if args.export_kv is not None:
        check_output_dir(args.export_kv, "--export-kv")
    spec = job_spec(args)
    if args.export_kv is not None:
        check_combination({**parallel_settings(spec.parallel), "export": "on"}, flags=True)
    reqs = parse_requests(args.input)
    model = preflight(spec)
    check_request_vocabulary(reqs, model.vocab_size)
    if args.memory_check:  # the prefixes' forward, then the new tokens'
        forwards = [sum(r.prefix for r in reqs), sum(len(r.new_tokens) for r in reqs)]
        check_local_ranks_fit(spec, job_memory(spec, forwards))
    res = run_job_on_ranks(prefill_job, spec, reqs, args.all_logits, bool(args.stats), args.export_kv)
    if res is not None:
        out = {"last_logits": res["last_logits"]}
        if args.all_logits:
            out["logits"] = res["logits"]
        if "aux_hidden" in res:
            out["aux_hidden"], out["aux_hidden_layers"] = res["aux_hidden"], res["aux_hidden_layers"]
        if "draft_logits" in res:
            out["draft_logits"], out["draft_to_target"] = res["draft_logits"], res["draft_to_target"]
        _save(out, args.output)
        if args.stats:
            write_stats(args.stats, res["stats"])
        info = res["info"]
        if info["tp_size"] == info["cp_size"]:
            ranks = f"{info['cp_size']} rank(s)" if info["pp_size"] == 1 else \
                f"{info['pp_size'] * info['cp_size']} ranks ({info['pp_size']} stages x CP {info['cp_size']})"
        else:
            ranks = "ranks " + ranks_text(info["pp_size"], info["tp_size"], info["cp_size"], info["dp_size"])[1]
        print(f"prefilled {len(reqs)} requests on {ranks}, layout {info['layout']}, "
              f"path {info['path']} (local capacity {info['capacity']}), {info['kv_cache']} KV cache"
              + (f", exchange {info['exchange']}" if info["exchange"] is not None else "")  # a pipeline has none
              + f" -> {args.output}" + (f" (stats: {args.stats})" if args.stats else "")
              + (f"; KV -> {args.export_kv}/<i>.safetensors" if args.export_kv is not None else ""))
        for line in family_of(model).work_report(info["stats_per_rank"]):  # DSA, V4: the indexer's work
            print(line)
    return 0


def cmd_run(args) -> int:
    if args.verify_capture is None:
        args.verify_capture = True  # the main job shows the self-check whatever the backend
    if args.json:
        check_output_path(args.json, "--json")
    spec = job_spec(args)
    model = preflight(spec)
    if args.memory_check:  # every bucket, and a second engine in the other float dtype
        forwards = [sum(len(t) for t in mixed_batch(1))]
        check_local_ranks_fit(spec, job_memory(spec, forwards, capture_all=spec.runtime.graph != "off",
                                               twin_dtype=twin_dtype(spec.runtime.dtype)))
    res = run_job_on_ranks(run_job, spec)
    rows = [
        ("model", res["model"]),
        ranks_text(res["pp_size"], res["tp_size"], res["cp_size"], res["dp_size"]),
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
        if res.get("exchange_reason") is not None:  # a ring chose its exchange for the batch
            rows += [
                ("KV stored per rank", f"{res['kv_stored_per_rank']} tokens (sharded; replicated: {res['tokens']} on "
                                       "every rank)"),
                ("exchange chosen", f"{res['exchange']} ({res['exchange_reason']})"),
                ("received per layer", f"{res['bytes_received_per_layer'] / 2**20:.2f} MiB a rank ({res['exchange']}, "
                                       "measured; vs the all-gather above)"),
            ]
    stats = res.get("stats", {})
    if "moe_layout" in stats:  # a mixture-of-experts model: its MLP traffic (docs/moe.md)
        imbalance = stats.get("moe_routing_imbalance")
        rows.append((f"MoE ({stats['moe_layout']}), {stats['moe_layers']} layers",
                     f"{stats['moe_bytes_sent'] / 2**20:.2f} MiB sent, {stats['moe_bytes_received'] / 2**20:.2f} MiB "
                     "received a rank per forward" + (f"; routing imbalance {imbalance:.2f} (max/mean pairs per "
                                                       "expert rank)" if imbalance is not None else "")))
    if "graph_s" in res:
        for c in res["comparisons"]:
            same = {True: "bitwise equal", False: "DIFFERS", None: "no graph"}[c["same_bucket_bitwise"]]
            rows.append((f"graph vs eager ({c['dtype']})",
                         f"same bucket: {same}; unpadded: max |diff| {c['max_abs_diff']:.3g}, "
                         f"relative {c['rel_diff']:.3g} (bucket {c['bucket']})"))
    print_table(rows)
    for line in family_of(model).work_report(res["stats_per_rank"]):  # DSA / V4: the eager forward's indexer work
        print(line)
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
    parser = _Parser(prog="graphcp", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", default=False,
                        help="print tracebacks of graphcp's errors (also GRAPHCP_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prefill", help="prefill the requests of a JSONL file and save the logits")
    p.add_argument("--input", required=True, help='REQUESTS.jsonl: {"tokens": [...], "prefix": K} a line')
    p.add_argument("--output", required=True, help="OUT.pt (torch.save dict)")
    p.add_argument("--all-logits", action="store_true", help="also save every new token's logits")
    p.add_argument("--export-kv", default=None, metavar="DIR",
                   help="write each request's KV to DIR/<i>.safetensors (graphcp.pd.load_kv reads it; docs/pd.md)")
    p.add_argument("--stats", default=None, metavar="STATS.json",
                   help="also write what each rank did: KV pool and stored tokens, and per forward its path, "
                        "bucket, exchange, new and cached tokens and bytes received (docs/sharded_kv.md)")
    add_draft_arg(p)
    add_runtime_args(p, None)
    p.set_defaults(func=cmd_prefill)

    p = sub.add_parser("run", help="the main job on the built-in default model: capture, replay, compare")
    add_runtime_args(p, "breakable")
    p.set_defaults(cp=2)
    p.add_argument("--json", default=None, help="also write the results as JSON")
    p.set_defaults(func=cmd_run)

    add_generate_parser(sub, _save)
    add_tune_parser(sub)
    add_profile_parser(sub)
    add_pd_demo_parser(sub)
    add_gpu_check_parser(sub)
    parser.commands = sub.choices  # for the unknown-flag error (_Parser.parse_args)
    for p in sub.choices.values():  # --debug after the command too; SUPPRESS keeps the top-level value
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line. graphcp's own errors become one stderr line and exit code 2
    (bad input) or 1 (a failed run); anything else is a bug and surfaces as one."""
    args = build_parser().parse_args(argv)
    interpret_triton_on_cpu(args, f"graphcp {args.command}")
    try:
        return int(args.func(args) or 0)
    except Exception as e:  # noqa: BLE001 - graphcp's errors are reported, the rest re-raised
        code = report(f"graphcp {args.command}", e, args.debug)
        if code is None:
            raise
        return code
