"""The runtime options every graphcp command that runs a model shares (run, prefill,
profile; gpu-check sweeps its own matrix of them): one parser helper, one conversion to a
:class:`JobSpec`, and the checks that can refuse a configuration before any rank starts."""

from __future__ import annotations

import argparse

from graphcp.cli.jobs import JobSpec
from graphcp.config import ModelConfig, ParallelConfig, RuntimeConfig
from graphcp.model.presets import resolve_model
from graphcp.options import (
    ATTENTION_BACKENDS,
    CLI_DTYPES,
    DEVICE_KINDS,
    EXCHANGES,
    GRAPH_BACKENDS,
    GRAPH_MODES,
    KV_CACHE_MODES,
    LAYOUTS,
)
from graphcp.options import MOE_LAYOUTS


def add_runtime_args(p: argparse.ArgumentParser, default_graph: str | None) -> None:
    """The model and RuntimeConfig flags (``default_graph`` None: breakable with the
    zigzag layout, off with interleave)."""
    p.add_argument("--model", default="default", help="checkpoint folder or preset name (default: the built-in preset)")
    p.add_argument("--dtype", default="float32", choices=CLI_DTYPES)
    p.add_argument("--device", default="cpu", choices=DEVICE_KINDS)
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (= TP ranks of the MLP)")
    p.add_argument("--layout", default="zigzag", choices=LAYOUTS)
    p.add_argument("--graph", default=default_graph, choices=GRAPH_MODES,
                   help="graph mode (default: breakable where supported, i.e. the zigzag layout)")
    p.add_argument("--graph-backend", default="auto", choices=GRAPH_BACKENDS)
    p.add_argument("--attention", default="torch", choices=ATTENTION_BACKENDS)
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
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--verify-capture", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each new bucket on a synthetic batch and compare it bitwise with the same-bucket "
                        "eager body (default: on for the trace graph backend, off for cuda; on for `graphcp run`)")
    p.add_argument("--moe", default="ep", choices=MOE_LAYOUTS,
                   help="mixture-of-experts layers: ep splits the experts over the CP ranks (all-to-all dispatch "
                        "and combine), tp shards every expert like the dense MLP (default: ep)")


def graph_mode(args: argparse.Namespace) -> str:
    return args.graph or ("breakable" if args.layout == "zigzag" else "off")


def job_spec(args: argparse.Namespace) -> JobSpec:
    """The flags of :func:`add_runtime_args` as a JobSpec (RuntimeConfig checks them)."""
    rt = RuntimeConfig(
        dtype=args.dtype, device=args.device, page_size=args.page_size, kv_tokens=args.kv_tokens,
        attention=args.attention, graph=graph_mode(args), graph_backend=args.graph_backend, layout=args.layout,
        max_requests=args.max_requests, collective_timeout_s=args.timeout, verify_capture=args.verify_capture,
        kv_cache=args.kv_cache, exchange=args.exchange, peak_tflops=args.peak_tflops,
        link_gb_per_s=args.link_gb_per_s,
        moe=args.moe,
    )
    return JobSpec(args.model, rt, args.buckets, args.cp)


def preflight(spec: JobSpec) -> None:
    """What can be refused before ranks start, in this process: the parallel config, the
    model's config.json against it, and the bucket file (each rank would fail the same
    way, only later and N times)."""
    parallel = ParallelConfig(cp_size=spec.cp_size)
    config = resolve_model(spec.model) / "config.json"
    parallel.check_model(ModelConfig.from_file(config), str(config), spec.runtime.moe)
    spec.buckets()
