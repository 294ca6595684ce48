"""The runtime options every graphcp command that runs a model shares (run, prefill,
profile; gpu-check sweeps its own matrix of them): one parser helper, one conversion to a
:class:`JobSpec`, and the checks that can refuse a configuration before any rank starts."""

from __future__ import annotations

import argparse
import os
import sys

from graphcp.attention.backends.triton import cpu_problem
from graphcp.checks import check_layer_list
from graphcp.combinations import check as check_combination
from graphcp.combinations import runtime_settings
from graphcp.config import DEFAULT_DECODE_BUCKETS, RuntimeConfig
from graphcp.dist import check_devices, local_ranks
from graphcp.jobs.spec import JobSpec
from graphcp.model.config import ModelConfig
from graphcp.model.eagle3.config import read_eagle3_config
from graphcp.model.family import family_of
from graphcp.model.presets import PRESETS, resolve_model
from graphcp.options import (
    ATTENTION_BACKENDS,
    CLI_DTYPES,
    DECODE_MERGES,
    DEVICE_KINDS,
    EXCHANGES,
    GRAPH_BACKENDS,
    GRAPH_MODES,
    KV_CACHE_MODES,
    LAYOUTS,
    MOE_LAYOUTS,
)


def int_list(text: str) -> tuple[int, ...]:
    """A flag's comma-separated integers (``1,5,9``)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,5,9, got {text!r}") from None


def help_text(doc: str) -> str:
    """A docstring as terminal text (a command's description): reST's double backticks go."""
    return doc.replace("``", "")


def add_runtime_args(p: argparse.ArgumentParser, default_graph: str | None) -> None:
    """The model and RuntimeConfig flags (``default_graph`` None: breakable)."""
    p.add_argument("--model", default="default",
                   help=f"checkpoint folder (config.json + safetensors) or a built-in preset: {', '.join(PRESETS)} "
                        "(default: %(default)s, written once to $GRAPHCP_CACHE or ~/.cache/graphcp/models)")
    p.add_argument("--dtype", default="float32", choices=CLI_DTYPES, help="model dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu", choices=DEVICE_KINDS, help="default: %(default)s")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (= TP ranks of the MLP; default: "
                                                     "%(default)s)")
    p.add_argument("--tp", type=int, default=None,
                   help="ranks of a stage, the MLP/MoE's TP degree; attention TP = tp / (dp x cp) splits heads inside "
                        "each CP partition (default: cp x dp, attention TP 1; docs/parallel.md)")
    p.add_argument("--dp", type=int, default=1, help="attention data-parallel replicas (default: %(default)s)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages, each a CP group of --cp ranks (pp x cp ranks in all, stage-major)")
    p.add_argument("--pp-layers", type=int_list, default=None, metavar="N,N,...",
                   help="decoder layers of each stage, e.g. 3,1 (default: an even split)")
    p.add_argument("--pp-microbatches", type=int, default=1, metavar="M",
                   help="micro-batches each prefill is pipelined as (stages overlap)")
    p.add_argument("--aux-hidden-layers", type=int_list, default=(), metavar="L,L,...",
                   help="decoder layers whose output hidden states prefill returns (OUT.pt 'aux_hidden'; "
                        "graphs copy them inside the captured segments)")
    p.add_argument("--layout", default="zigzag", choices=LAYOUTS,
                   help="how a request's tokens are split over the CP ranks (default: %(default)s)")
    p.add_argument("--graph", default=default_graph, choices=GRAPH_MODES,
                   help="graph mode (default: breakable)")
    p.add_argument("--graph-backend", default="auto", choices=GRAPH_BACKENDS)
    p.add_argument("--attention", default="torch", choices=ATTENTION_BACKENDS,
                   help="attention backend (default: %(default)s; triton on a CPU runs Triton's interpreter)")
    p.add_argument("--buckets", default=None, help="bucket file written by `graphcp tune`")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool size in tokens (one rank's pool)")
    p.add_argument("--kv-cache", default="replicated", choices=KV_CACHE_MODES,
                   help="replicated: every rank holds the batch's KV (all-gather); sharded: each rank its own zigzag "
                        "blocks, attention by a ring; layer-split: each rank the cache of its ceil(L/C) layers plus "
                        "one scratch layer (docs/pd.md)")
    p.add_argument("--exchange", default="auto", choices=EXCHANGES,
                   help="the sharded cache's ring (auto: pass-kv or pass-q chosen per batch)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak attention TFLOP/s of one GPU, for --exchange auto (default: H100/H200 bf16 dense)")
    p.add_argument("--link-gb-per-s", type=float, default=450.0,
                   help="link GB/s per direction per GPU, for --exchange auto (default: H100/H200 NVLink)")
    p.add_argument("--max-requests", type=int, default=64)
    p.add_argument("--state-slots", type=int, default=None,
                   help="a linear-attention hybrid's cache: live requests whose linear layers' states it keeps "
                        "(default: --max-requests; docs/hybrid.md)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--verify-capture", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each new bucket on a synthetic batch and compare it bitwise with the same-bucket "
                        "eager body (default: on for the trace graph backend, off for cuda; on for `graphcp run`)")
    p.add_argument("--memory-check", action=argparse.BooleanOptionalAction, default=True,
                   help="estimate a rank's memory (weights, KV pool, graphs) and refuse local ranks that do not fit "
                        "the machine before launching them (default: on)")
    p.add_argument("--moe", default="ep", choices=MOE_LAYOUTS,
                   help="mixture-of-experts layers: ep splits the experts over the CP ranks (all-to-all dispatch "
                        "and combine), tp shards every expert like the dense MLP (default: ep)")


def add_draft_arg(p: argparse.ArgumentParser) -> None:
    """``--draft DIR`` (RuntimeConfig.draft): the commands whose outputs carry a draft's (prefill)."""
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="an EAGLE-3 draft checkpoint: also prefill the draft over the same rows (its K/V cached and "
                        "exported with the target's) and save 'draft_logits' and 'draft_to_target' "
                        "(docs/speculative.md)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """The decode flags (RuntimeConfig.decode_merge, decode_buckets): the commands that decode (generate)."""
    p.add_argument("--decode-merge", default="auto", choices=DECODE_MERGES,
                   help="how a decode step over --kv-cache sharded merges the ranks' partial attention (auto: the "
                        "one that moves fewer bytes; docs/decode.md)")
    p.add_argument("--decode-buckets", type=int_list, default=DEFAULT_DECODE_BUCKETS, metavar="N,N,...",
                   help="the decode batch sizes a decode graph is captured for (default: 1,2,4,...,64)")


def interpret_triton_on_cpu(args: argparse.Namespace, prog: str) -> None:
    """``--attention triton`` on a CPU runs Triton's interpreter: chosen here, in the
    launching process before any rank imports triton (ranks inherit the environment),
    and said once on stderr."""
    if getattr(args, "attention", None) == "triton" and cpu_problem(args.device) is not None:
        os.environ["TRITON_INTERPRET"] = "1"
        print(f"{prog}: note: --attention triton on a CPU runs Triton's interpreter (TRITON_INTERPRET=1 set): "
              "exact, but slow", file=sys.stderr)


def graph_mode(args: argparse.Namespace) -> str:
    return args.graph or "breakable"


def job_spec(args: argparse.Namespace) -> JobSpec:
    """The flags of :func:`add_runtime_args` as a JobSpec (RuntimeConfig checks them; the
    pairs that do not combine are refused here first, in the flags' names)."""
    check_combination(runtime_settings(argparse.Namespace(**{**vars(args), "graph": graph_mode(args)})), flags=True)
    rt = RuntimeConfig(
        dtype=args.dtype, device=args.device, page_size=args.page_size, kv_tokens=args.kv_tokens,
        attention=args.attention, graph=graph_mode(args), graph_backend=args.graph_backend, layout=args.layout,
        max_requests=args.max_requests, collective_timeout_s=args.timeout, verify_capture=args.verify_capture,
        kv_cache=args.kv_cache, exchange=args.exchange, peak_tflops=args.peak_tflops,
        link_gb_per_s=args.link_gb_per_s,
        aux_hidden_layers=args.aux_hidden_layers, microbatches=args.pp_microbatches, moe=args.moe,
        draft=getattr(args, "draft", None),  # prefill's --draft
        decode_merge=getattr(args, "decode_merge", "auto"),  # generate's decode flags
        decode_buckets=getattr(args, "decode_buckets", DEFAULT_DECODE_BUCKETS),
        state_slots=args.state_slots,
    )
    return JobSpec(args.model, rt, args.buckets, args.cp, args.pp, args.pp_layers, args.tp, args.dp)


def preflight(spec: JobSpec) -> ModelConfig:
    """What can be refused before ranks start, in this process: the parallel config, the
    model's config.json against it (TP shards, pipeline stages, auxiliary layers, the
    options this kind of model does not combine with, in the flags' names), and the bucket file
    and its fit to the run (each rank would fail the same way, only later and N times).
    The model's config."""
    check_ranks_fit_devices(spec)
    config = resolve_model(spec.model) / "config.json"
    model = ModelConfig.from_file(config)
    model.check_combination(spec.runtime, spec.parallel, flags=True)
    model.check_parallel(spec.parallel, str(config), spec.runtime.moe)
    check_layer_list(spec.runtime.aux_hidden_layers, f"--aux-hidden-layers ({config})", model.num_layers)
    if spec.runtime.draft is not None:  # an EAGLE-3 draft: its config against the target, before any rank starts
        read_eagle3_config(spec.runtime.draft, model)
    family_of(model).check_run(model, spec.runtime, spec.parallel, flags=True)
    buckets = spec.buckets()
    if buckets is not None:
        buckets.check_compatible(spec.cp_size, spec.runtime.layout)
    return model


def check_ranks_fit_devices(spec: JobSpec) -> None:
    """``--device cuda`` on a torch without CUDA, on a machine with no visible GPU, or with
    more ranks than GPUs (the mesh needs one GPU a rank): refused here, in the flags' names,
    before the model is read or any rank starts."""
    p = spec.parallel
    ranks = local_ranks(p.world_size)
    asked = (f"--device {spec.runtime.device} with {p.world_size} rank(s) (--pp {p.pp_size} x --tp {p.tp_size}; "
             f"--cp {p.cp_size}, --dp {p.dp_size})")
    check_devices(spec.runtime.device, ranks, asked, "--device cpu")

