"""The runtime flags (:mod:`graphcp.jobs.args`) as a :class:`JobSpec`, and what can be
refused before any rank starts, in the flags' names: the pairs of flags that do not
combine, the model's config.json against the run (the input files, the bucket file
among them, were checked before: :mod:`graphcp.cli.inputs`). Imported after the flags
are parsed (this imports torch)."""

from __future__ import annotations

import argparse
import os
import sys

from graphcp.attention.backends.triton import cpu_problem
from graphcp.attention.registry import backend_info
from graphcp.checks import DEFAULT_DECODE_BUCKETS, check_layer_list
from graphcp.combinations import check as check_combination
from graphcp.combinations import runtime_settings
from graphcp.config import RuntimeConfig
from graphcp.dist import check_devices, local_ranks
from graphcp.errors import ConfigError
from graphcp.jobs.args import graph_mode
from graphcp.jobs.spec import JobSpec
from graphcp.model.config import ModelConfig
from graphcp.model.eagle3.config import read_eagle3_config
from graphcp.model.family import family_of
from graphcp.model.presets import resolve_model


def interpret_triton_on_cpu(args: argparse.Namespace, prog: str) -> None:
    """``--attention triton`` on a CPU runs Triton's interpreter: chosen here, in the
    launching process before any rank imports triton (ranks inherit the environment),
    and said once on stderr."""
    if getattr(args, "attention", None) == "triton" and cpu_problem(args.device) is not None:
        os.environ["TRITON_INTERPRET"] = "1"
        print(f"{prog}: note: --attention triton on a CPU runs Triton's interpreter (TRITON_INTERPRET=1 set): "
              "exact, but slow", file=sys.stderr)


def check_flags(args: argparse.Namespace) -> None:
    """What RuntimeConfig and ParallelConfig refuse across their fields, said in the
    flags' names before they are built (each flag's own range argparse checked)."""
    split = args.dp * args.cp
    if args.tp is not None and args.tp % split:
        raise ConfigError(f"--tp {args.tp} must be a multiple of --dp x --cp = {args.dp} x {args.cp} = {split} "
                          f"(attention TP = tp / (dp x cp)): give --tp a multiple of {split}, or --cp / --dp that "
                          f"divide {args.tp}")
    if args.pp_layers is not None and len(args.pp_layers) != args.pp:
        raise ConfigError(f"--pp-layers {','.join(map(str, args.pp_layers))} lists {len(args.pp_layers)} stages, "
                          f"expected --pp {args.pp} (one layer count a stage)")
    if args.graph_backend == "cuda" and args.device == "cpu":
        raise ConfigError("--graph-backend cuda captures CUDA graphs and needs --device cuda; on a CPU use "
                          "--graph-backend trace (or auto)")
    if getattr(args, "draft", None) is not None and args.pp_microbatches != 1:
        raise ConfigError(f"--draft runs one forward a batch, got --pp-microbatches {args.pp_microbatches} "
                          "(expected 1: micro-batches are not built for a draft)")


def job_spec(args: argparse.Namespace) -> JobSpec:
    """The flags of :func:`graphcp.jobs.args.add_runtime_args` as a JobSpec (RuntimeConfig
    checks them; the pairs that do not combine, and what the configs refuse across
    fields, are refused here first, in the flags' names)."""
    check_combination(runtime_settings(argparse.Namespace(**{**vars(args), "graph": graph_mode(args)})), flags=True)
    check_flags(args)
    rt = RuntimeConfig(
        dtype=args.dtype, device=args.device, page_size=args.page_size, kv_tokens=args.kv_tokens,
        attention=args.attention, graph=graph_mode(args), graph_backend=args.graph_backend, layout=args.layout,
        max_requests=args.max_requests, collective_timeout_s=args.timeout, verify_capture=args.verify_capture,
        kv_cache=args.kv_cache, exchange=args.exchange, peak_tflops=args.peak_tflops,
        link_gb_per_s=args.link_gb_per_s,
        aux_hidden_layers=args.aux_hidden_layers, microbatches=args.pp_microbatches, moe=args.moe or "ep",
        draft=getattr(args, "draft", None),  # prefill's --draft
        decode_merge=getattr(args, "decode_merge", "auto"),  # generate's decode flags
        decode_buckets=getattr(args, "decode_buckets", DEFAULT_DECODE_BUCKETS),
        state_slots=args.state_slots,
    )
    return JobSpec(args.model, rt, args.buckets, args.cp, args.pp, args.pp_layers, args.tp, args.dp)


def preflight(spec: JobSpec, moe_flag: str | None = None, prog: str = "graphcp") -> ModelConfig:
    """What can be refused before ranks start, in this process: the parallel config, the
    model's config.json against it (TP shards, pipeline stages, auxiliary layers, the
    options this kind of model does not combine with, in the flags' names): each rank would
    fail the same way, only later and N times.
    ``moe_flag``: ``--moe`` as typed (flags the model has no use for are noted:
    :func:`note_unused_flags`).
    The model's config."""
    check_ranks_fit_devices(spec)
    config = resolve_model(spec.model, "--model") / "config.json"
    model = ModelConfig.from_file(config)
    model.check_combination(spec.runtime, spec.parallel, flags=True)
    rt = spec.runtime
    if rt.device == "cpu" and rt.attention != "auto" and backend_info(rt.attention).cls.gpu_kernels:
        raise ConfigError(f"--attention {rt.attention} runs CUDA kernels and needs --device cuda (a GPU); on a CPU "
                          "use --attention torch or triton")
    model.check_parallel(spec.parallel, str(config), spec.runtime.moe, flags=True)
    check_layer_list(spec.runtime.aux_hidden_layers, f"--aux-hidden-layers ({config})", model.num_layers)
    if spec.runtime.draft is not None:  # an EAGLE-3 draft: its config against the target, before any rank starts
        read_eagle3_config(spec.runtime.draft, model)
    family = family_of(model)
    family.check_run(model, spec.runtime, spec.parallel, flags=True)
    note_unused_flags(spec, model, moe_flag, str(config), prog)
    return model


def note_unused_flags(spec: JobSpec, model: ModelConfig, moe_flag: str | None, config: str, prog: str) -> None:
    """Flags given that this model has nothing to apply to, said in a note on stderr (the
    run goes on): ``--moe`` without mixture-of-experts layers, ``--state-slots`` without
    linear-attention layers. ``moe_flag``: ``--moe`` as typed (None: not given)."""
    unused = []
    if moe_flag is not None and not family_of(model).experts(model):
        unused.append((f"--moe {moe_flag}", "mixture-of-experts"))
    if spec.runtime.state_slots is not None and model.hybrid is None:  # (None: not given)
        unused.append((f"--state-slots {spec.runtime.state_slots}", "linear-attention"))
    for flag, layers in unused:
        print(f"{prog}: note: {flag} has no effect: {config} has no {layers} layers", file=sys.stderr)


def check_ranks_fit_devices(spec: JobSpec) -> None:
    """``--device cuda`` on a torch without CUDA, on a machine with no visible GPU, or with
    more ranks than GPUs (the mesh needs one GPU a rank): refused here, in the flags' names,
    before the model is read or any rank starts."""
    p = spec.parallel
    ranks = local_ranks(p.world_size)
    asked = (f"--device {spec.runtime.device} with {p.world_size} rank(s) (--pp {p.pp_size} x --tp {p.tp_size}; "
             f"--cp {p.cp_size}, --dp {p.dp_size})")
    check_devices(spec.runtime.device, ranks, asked, "--device cpu")
