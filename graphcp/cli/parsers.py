"""The flags of ``graphcp prefill``, ``run``, ``generate`` and ``pd-demo``. No torch here: each
command's work (``func``, a ``module:function`` name) is imported once its flags are
parsed (:mod:`graphcp.cli.main`)."""

from __future__ import annotations

import argparse

from graphcp.jobs.args import add_decode_args, add_draft_arg, add_runtime_args, bounded, int_list
from graphcp.options import KV_CACHE_MODES

#: what ``--help`` shows in place of the runtime flags in a command's usage line (they
#: are listed, each with its default, under "options")
RUNTIME_FLAGS = "[runtime flags, listed below]"


def add_prefill_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("prefill", help="prefill the requests of a JSONL file and save the logits",
                       usage=f"graphcp prefill --input REQUESTS.jsonl --output OUT.pt [options] {RUNTIME_FLAGS}")
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
    p.set_defaults(func="graphcp.cli.commands:cmd_prefill")
    return p


def add_run_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="the main job on the built-in default model: capture, replay, compare",
                       usage=f"graphcp run [--json OUT.json] {RUNTIME_FLAGS}")
    add_runtime_args(p, "breakable")
    p.set_defaults(cp=2)
    p.add_argument("--json", default=None, help="also write the results as JSON")
    p.set_defaults(func="graphcp.cli.commands:cmd_run")
    return p


def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="greedy generation of a JSONL file's requests and conversations",
                       usage=f"graphcp generate (--input REQUESTS.jsonl | --import-kv DIR) --output OUT.pt "
                             f"--max-new-tokens N [options] {RUNTIME_FLAGS}")
    p.add_argument("--input", default=None,
                   help='REQUESTS.jsonl: {"tokens": [...], "prefix": K} or {"turns": [[...], ...], '
                        '"max_new_tokens": N} a line')
    p.add_argument("--import-kv", default=None, metavar="DIR",
                   help="instead of --input: continue the requests whose KV `graphcp prefill --export-kv DIR` wrote "
                        "(DIR/<i>.safetensors, any prefill shape), from their first tokens (docs/pd.md)")
    p.add_argument("--output", required=True, help="OUT.pt (torch.save dict: tokens, finish, logits)")
    p.add_argument("--max-new-tokens", type=bounded(int, 1), required=True, metavar="N",
                   help="tokens generated a turn, at most")
    p.add_argument("--stop", type=int_list(0), default=None, metavar="ID,ID,...",
                   help="stop tokens: a turn ends after generating one (it is kept; default: none)")
    p.add_argument("--save-logits", action="store_true", help="also save each step's logits")
    p.add_argument("--stats", default=None, metavar="STATS.json",
                   help="also write what each rank did, every decode step included (docs/decode.md)")
    add_draft_arg(p)
    p.add_argument("--draft-tokens", type=bounded(int, 1), default=None, metavar="K",
                   help="speculative decoding with the --draft: K draft tokens verified a step, at most the largest "
                        "--decode-buckets less one (the same tokens in fewer steps; docs/speculative.md)")
    add_decode_args(p)
    add_runtime_args(p, None)
    p.set_defaults(func="graphcp.cli.generate:cmd_generate")
    return p


def add_pd_demo_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("pd-demo",
                       help="prefill at one shape, hand the KV to a graphcp decode engine of another, check the tokens",
                       usage=f"graphcp pd-demo [--transport mooncake|file] [--decode-cp 2] [options] {RUNTIME_FLAGS}")
    add_runtime_args(p, "breakable")
    p.set_defaults(cp=4, kv_cache="sharded", func="graphcp.cli.pd_demo:cmd_pd_demo")
    p.add_argument("--decode-cp", type=bounded(int, 1), default=2,
                   help="the decode engine's CP ranks (the runtime flags' --cp, --tp, --pp, --dp are the prefill's; "
                        "default: %(default)s)")
    p.add_argument("--decode-kv-cache", default=None, choices=KV_CACHE_MODES,
                   help="the decode engine's cache mode (default: sharded, or the first of layer-split, replicated "
                        "the model decodes on)")
    p.add_argument("--transport", default=None, choices=("mooncake", "file"),
                   help="mooncake: the transfer engine on loopback TCP (the .[pd] extra); file: a safetensors file "
                        "(default: mooncake where it imports, else file)")
    p.add_argument("--prompt-tokens", type=bounded(int, 1), default=1024,
                   help="the prompt's length (default: %(default)s)")
    p.add_argument("--prefix-tokens", type=bounded(int, 0), default=384,
                   help="of which prefilled first, as a cached prefix (default: %(default)s)")
    p.add_argument("--steps", type=bounded(int, 1), default=8,
                   help="greedy tokens the decode side generates (default: %(default)s)")
    p.add_argument("--transfer-timeout", type=bounded(float, 0, lo_open=True), default=60.0,
                   help="seconds for each transfer step (default: %(default)s)")
    return p


PROFILE_HELP = """graphcp profile: warm up, then profile a measured workload, per rank.

CPU (--tool torch, the default there): every rank runs under torch.profiler and
writes trace_rank<r>.json (open it in Perfetto) and summary_rank<r>.json; rank 0's
launcher merges them into summary.md and summary.json. CUDA (--tool nsys, the
default there): re-run under nsys profile and summarise the NVTX ranges of the
report the same way; with no nsys on PATH, print the commands to run. See
profiles/README.md.
"""
#: ``--tool``: auto is torch on a CPU, nsys on CUDA
PROFILE_TOOLS = ("auto", "torch", "nsys", "nvtx")


def add_profile_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("profile", help="profile a workload: per-rank traces and a range summary",
                       description=PROFILE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="graphcp profile --out DIR [--workload FILE | --synthetic NAME] [options] "
                             + RUNTIME_FLAGS)
    add_runtime_args(p, "breakable")
    p.set_defaults(cp=2)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None,
                     help='JSONL: {"extend": [...], "prefix": [...]} a batch a line (default: six small batches)')
    src.add_argument("--synthetic", default=None, help="NAME[:k=v,...], see python -m graphcp.tune.workload")
    p.add_argument("--seed", type=bounded(int, 0), default=0,
                   help="token ids and synthetic workloads (default: %(default)s)")
    p.add_argument("--warmup", type=bounded(int, 0), default=1,
                   help="unmeasured passes over the workload (captures happen here; default: %(default)s)")
    p.add_argument("--iters", type=bounded(int, 1), default=2,
                   help="measured passes over the workload (default: %(default)s)")
    p.add_argument("--max-batches", type=bounded(int, 1), default=None,
                   help="use the first N batches of the workload (default: all)")
    p.add_argument("--out", required=True, help="output folder: summary.md/json, summary_rank<r>.json, traces")
    p.add_argument("--trace-dir", default=None, help="where the Chrome traces go (default: --out)")
    p.add_argument("--tool", default="auto", choices=PROFILE_TOOLS,
                   help="auto: torch on CPU, nsys on CUDA; nvtx: ranges only (run under your own nsys; "
                        "default: %(default)s)")
    p.add_argument("--from-nsys", default=None, nargs="+", metavar="REPORT",
                   help="summarise existing .nsys-rep reports (or their nvtx_pushpop_trace CSVs) into --out")
    p.add_argument("--label", default=None, help="title of summary.md (default: <device>-cp<N>-<graph>)")
    p.set_defaults(func="graphcp.profile.cli:cmd_profile")
    return p
