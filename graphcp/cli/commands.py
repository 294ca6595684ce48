"""The work of ``graphcp prefill`` and ``graphcp run``, imported once their flags are
parsed (:mod:`graphcp.cli.main`): check the flags and the model up front, run the job
on every rank (:mod:`graphcp.cli.jobs`), write and print what it returned."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from graphcp.checks import check_output_dir, check_output_path
from graphcp.cli.jobs import INTERPRETER_SCALE, interpreted, mixed_batch, prefill_job, run_job, twin_dtype
from graphcp.cli.requests import FileRequest, check_context
from graphcp.cli.table import print_table, ranks_text
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings
from graphcp.dist import sigint_deferred
from graphcp.jobs.memory import check_local_ranks_fit, job_memory
from graphcp.jobs.preflight import job_spec, preflight
from graphcp.jobs.spec import run_job_on_ranks
from graphcp.jobs.tolerance import RUN_TOLERANCE
from graphcp.model.family import family_of
from graphcp.runtime.batch import check_vocabulary
from graphcp.runtime.stats import write_stats


def write_outputs(files: dict[str, Callable[[str], Any]], folders: dict[str, str] | None = None) -> None:
    """Write a command's outputs, all or none. ``files`` maps each path to what writes it
    (given the path to write): each is written to a temporary file beside its path.
    ``folders`` maps a folder to a folder of files the ranks wrote (``--export-kv``'s staging
    folder), whose files move into it. Then every file is renamed into place at once, a
    Ctrl-C held until the renames are done: one that comes before leaves every old file
    as it was and no new one, one that comes during is acted on after them (every file
    whole)."""
    tmps: dict[str, str] = {}
    try:
        for path, write in files.items():
            tmps[path] = f"{path}.tmp-{os.getpid()}"
            write(tmps[path])
        with sigint_deferred():
            for path, tmp in tmps.items():
                os.replace(tmp, path)
            for folder, staged in (folders or {}).items():
                Path(folder).mkdir(exist_ok=True)
                for f in sorted(Path(staged).iterdir()):
                    os.replace(f, Path(folder) / f.name)
    finally:
        for tmp in tmps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)


@contextlib.contextmanager
def staging_beside(folder: str | None) -> Iterator[str | None]:
    """A name for a folder beside ``folder`` (None: none) that the ranks write into; it
    is removed on the way out, whatever happened (a rank stopped by a Ctrl-C cannot)."""
    if folder is None:
        yield None
        return
    p = Path(folder)
    staging = p.with_name(f".{p.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        yield str(staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_prefill_outputs(args, res: dict, staging: str | None) -> None:
    """OUT.pt (and --stats, --export-kv's files from ``staging``) from rank 0's result."""
    out = {"last_logits": res["last_logits"]}
    if args.all_logits:
        out["logits"] = res["logits"]
    if "aux_hidden" in res:
        out["aux_hidden"], out["aux_hidden_layers"] = res["aux_hidden"], res["aux_hidden_layers"]
    if "draft_logits" in res:
        out["draft_logits"], out["draft_to_target"] = res["draft_logits"], res["draft_to_target"]
    files = {args.output: lambda tmp: torch.save(out, tmp)}
    if args.stats:
        files[args.stats] = lambda tmp: write_stats(tmp, res["stats"])
    write_outputs(files, {args.export_kv: staging} if staging is not None else None)


def check_requests(reqs: list[FileRequest], vocab_size: int, context: int) -> None:
    """What a rank would refuse of the file's requests, before any starts, naming the file
    and line: a token outside the vocabulary, a request past the model's context."""
    check_vocabulary([np.asarray(r.tokens, dtype=np.int64) for r in reqs], vocab_size, lambda j: reqs[j].where)
    for r in reqs:
        check_context(r.where, len(r.tokens), context)


def cmd_prefill(args) -> int:
    check_output_path(args.output, "--output")  # before any work: not after the forward
    if args.stats:
        check_output_path(args.stats, "--stats")
    if args.export_kv is not None:
        check_output_dir(args.export_kv, "--export-kv")
    spec = job_spec(args)
    if args.export_kv is not None:
        check_combination({**parallel_settings(spec.parallel), "export": "on"}, flags=True)
    reqs = args.requests  # read with the flags (graphcp.cli.inputs)
    model = preflight(spec, args.moe, f"graphcp {args.command}")
    check_requests(reqs, model.vocab_size, model.max_position_embeddings)
    if args.memory_check:  # the prefixes' forward, then the new tokens'
        forwards = [sum(r.prefix for r in reqs), sum(len(r.new_tokens) for r in reqs)]
        check_local_ranks_fit(spec, job_memory(spec, forwards))
    with staging_beside(args.export_kv) as staging:
        res = run_job_on_ranks(prefill_job, spec, reqs, args.all_logits, bool(args.stats), staging)
        if res is not None:
            write_prefill_outputs(args, res, staging)
    if res is not None:
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
              + (f"; KV -> {Path(args.export_kv) / '<i>.safetensors'}" if args.export_kv is not None else ""))
        for line in family_of(model).work_report(info["stats_per_rank"]):  # DSA, V4: the indexer's work
            print(line)
    return 0


def cmd_run(args) -> int:
    if args.verify_capture is None:
        args.verify_capture = True  # the main job shows the self-check whatever the backend
    if args.json:
        check_output_path(args.json, "--json")
    spec = job_spec(args)
    model = preflight(spec, args.moe, f"graphcp {args.command}")
    if args.memory_check:  # every bucket, and a second engine in the other float dtype
        forwards = [sum(len(t) for t in mixed_batch(1))]
        check_local_ranks_fit(spec, job_memory(spec, forwards, capture_all=spec.runtime.graph != "off",
                                               twin_dtype=twin_dtype(spec.runtime.dtype)))
    if interpreted(spec):
        tokens = sum(len(t) for t in mixed_batch(1, scale=INTERPRETER_SCALE))
        print(f"graphcp run: note: in Triton's interpreter the batch is {tokens} tokens (not "
              f"{sum(len(t) for t in mixed_batch(1))}) and only the buckets it uses are captured: a few minutes",
              file=sys.stderr)
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
        write_outputs({args.json: lambda tmp: Path(tmp).write_text(json.dumps(res, indent=2, default=str) + "\n")})
    for c in res.get("comparisons", []):
        # the replay must equal the same-bucket body exactly; the unpadded forward only
        # within the rounding of matmuls over padded rows
        bound = RUN_TOLERANCE[c["dtype"]]
        if c["same_bucket_bitwise"] is False or not c["rel_diff"] <= bound:
            print(f"graph output differs from eager in {c['dtype']} (same bucket bitwise: {c['same_bucket_bitwise']}, "
                  f"relative {c['rel_diff']:.3g}, expected <= {bound:g})", file=sys.stderr)
            return 1
    return 0
