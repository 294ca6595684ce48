"""The runtime flags every graphcp command that runs a model shares (run, prefill,
profile, pd-demo; gpu-check sweeps its own matrix of them).

No torch here: the flags are parsed, and a bad value refused in the flag's name,
before anything heavy is imported (``graphcp run --cp abc`` answers at once). What
the flags turn into, and the checks that need the model or the configs, are in
:mod:`graphcp.jobs.preflight`."""

from __future__ import annotations

import argparse
import math
from typing import Callable

from graphcp.checks import (
    DEFAULT_DECODE_BUCKETS,
    MAX_CP,
    MAX_DECODE_BUCKETS,
    MAX_GB_PER_S,
    MAX_LAYERS,
    MAX_MICROBATCHES,
    MAX_PAGE_SIZE,
    MAX_REQUESTS,
    MAX_TFLOPS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
)
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


def bounded(cast: type, lo: float, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: an int (or a finite float) in range. argparse names the flag:
    ``argument --cp: expected an integer >= 1 and <= 1024, got '0'``."""
    kind, show = ("an integer", str) if cast is int else ("a number", "{:g}".format)
    expected = f"{kind} {'>' if lo_open else '>='} {show(lo)}" + (f" and <= {show(hi)}" if hi is not None else "")

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return v

    parse.__name__ = kind
    return parse


def int_list(lo: int = 0, distinct: bool = False, hi: int | None = None, increasing: bool = False,
             most: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated integers (``1,5,9``), each in ``[lo, hi]``
    (``increasing``: each larger than the one before; ``most``: at most that many)."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            out = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,5,9, got {text!r}") from None
        if any(v < lo for v in out) or (hi is not None and any(v > hi for v in out)):
            raise argparse.ArgumentTypeError(f"expected integers >= {lo}" + (f" and <= {hi}" if hi is not None else "")
                                             + f", got {text!r}")
        if distinct and len(set(out)) != len(out):
            raise argparse.ArgumentTypeError(f"expected distinct integers, got {text!r}")
        if increasing and any(a >= b for a, b in zip(out, out[1:])):
            raise argparse.ArgumentTypeError(f"expected increasing integers such as 1,2,4, got {text!r}")
        if most is not None and len(out) > most:
            raise argparse.ArgumentTypeError(f"expected at most {most} integers, got {len(out)}")
        return out

    parse.__name__ = "list"
    return parse


def help_text(doc: str) -> str:
    """A docstring as terminal text (a command's description): reST's double backticks go."""
    return doc.replace("``", "")


class ModelFlag(argparse.Action):
    """``--model``: its help lists the built-in presets, which the model families declare
    (importing them imports torch): read when ``--help`` is shown, not to parse flags."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)

    @property
    def help(self) -> str:
        from graphcp.model.presets import PRESETS

        return (f"checkpoint folder (config.json + safetensors) or a built-in preset: {', '.join(PRESETS)} "
                "(default: %(default)s; presets are written once to $GRAPHCP_CACHE/models, by default "
                "~/.cache/graphcp/models)")

    @help.setter
    def help(self, value) -> None:  # argparse.Action.__init__ assigns it
        pass


def add_runtime_args(p: argparse.ArgumentParser, default_graph: str | None) -> None:
    """The model and RuntimeConfig flags (``default_graph`` None: breakable)."""
    p.add_argument("--model", default="default", action=ModelFlag)
    p.add_argument("--dtype", default="float32", choices=CLI_DTYPES, help="model dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu", choices=DEVICE_KINDS, help="default: %(default)s")
    p.add_argument("--cp", type=bounded(int, 1, MAX_CP), default=1,
                   help="context-parallel ranks (= TP ranks of the MLP; default: %(default)s)")
    p.add_argument("--tp", type=bounded(int, 1, MAX_CP), default=None,
                   help="ranks of a stage, the MLP/MoE's TP degree; attention TP = tp / (dp x cp) splits heads inside "
                        "each CP partition (default: cp x dp, attention TP 1; docs/parallel.md)")
    p.add_argument("--dp", type=bounded(int, 1, MAX_CP), default=1,
                   help="attention data-parallel replicas (default: %(default)s)")
    p.add_argument("--pp", type=bounded(int, 1, MAX_LAYERS), default=1,
                   help="pipeline stages, each a CP group of --cp ranks (pp x cp ranks in all, stage-major; "
                        "default: %(default)s)")
    p.add_argument("--pp-layers", type=int_list(lo=1), default=None, metavar="N,N,...",
                   help="decoder layers of each stage, e.g. 3,1 (default: an even split)")
    p.add_argument("--pp-microbatches", type=bounded(int, 1, MAX_MICROBATCHES), default=1, metavar="M",
                   help="micro-batches each prefill is pipelined as (stages overlap; default: %(default)s)")
    p.add_argument("--aux-hidden-layers", type=int_list(lo=0, distinct=True), default=(), metavar="L,L,...",
                   help="decoder layers whose output hidden states prefill returns (OUT.pt 'aux_hidden'; "
                        "graphs copy them inside the captured segments; default: none)")
    p.add_argument("--layout", default="zigzag", choices=LAYOUTS,
                   help="how a request's tokens are split over the CP ranks (default: %(default)s)")
    p.add_argument("--graph", default=default_graph, choices=GRAPH_MODES,
                   help="graph mode (default: breakable)")
    p.add_argument("--graph-backend", default="auto", choices=GRAPH_BACKENDS,
                   help="what captures the graphs: cuda (CUDA graphs, --device cuda), trace (a CPU stand-in that "
                        "proves exactness); default: %(default)s, cuda on a GPU and trace on a CPU")
    p.add_argument("--attention", default="torch", choices=ATTENTION_BACKENDS,
                   help="attention backend (default: %(default)s; triton on a CPU runs Triton's interpreter)")
    p.add_argument("--buckets", default=None, help="bucket file written by `graphcp tune` (default: powers of two)")
    p.add_argument("--page-size", type=bounded(int, 1, MAX_PAGE_SIZE), default=16,
                   help="tokens a KV page holds (default: %(default)s)")
    p.add_argument("--kv-tokens", type=bounded(int, 1, MAX_TOKENS), default=None,
                   help="KV pool size in tokens, one rank's pool (default: 4 contexts of the model, at most 64K)")
    p.add_argument("--kv-cache", default="replicated", choices=KV_CACHE_MODES,
                   help="replicated: every rank holds the batch's KV (all-gather); sharded: each rank its own zigzag "
                        "blocks, attention by a ring; layer-split: each rank the cache of its ceil(L/C) layers plus "
                        "one scratch layer (docs/pd.md; default: %(default)s)")
    p.add_argument("--exchange", default="auto", choices=EXCHANGES,
                   help="the sharded cache's ring (auto: pass-kv or pass-q chosen per batch; default: %(default)s)")
    p.add_argument("--peak-tflops", type=bounded(float, 0, MAX_TFLOPS, lo_open=True), default=989.0,
                   help="peak attention TFLOP/s of one GPU, for --exchange auto (default: %(default)s, H100/H200 bf16 "
                        "dense)")
    p.add_argument("--link-gb-per-s", type=bounded(float, 0, MAX_GB_PER_S, lo_open=True), default=450.0,
                   help="link GB/s per direction per GPU, for --exchange auto (default: %(default)s, H100/H200 NVLink)")
    p.add_argument("--max-requests", type=bounded(int, 1, MAX_REQUESTS), default=64,
                   help="requests a batch may hold (kernel backends preallocate for them; default: %(default)s)")
    p.add_argument("--state-slots", type=bounded(int, 1, MAX_REQUESTS), default=None,
                   help="a linear-attention hybrid's cache: live requests whose linear layers' states it keeps "
                        "(default: --max-requests; docs/hybrid.md; another model notes it has no effect)")
    p.add_argument("--timeout", type=bounded(float, 0, MAX_TIMEOUT_S, lo_open=True), default=300.0,
                   help="seconds a collective may take before the run fails (default: %(default)s)")
    p.add_argument("--verify-capture", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each new bucket on a synthetic batch and compare it bitwise with the same-bucket "
                        "eager body (default: on for the trace graph backend, off for cuda; on for `graphcp run`)")
    p.add_argument("--memory-check", action=argparse.BooleanOptionalAction, default=True,
                   help="estimate a rank's memory (weights, KV pool, graphs) and refuse local ranks that do not fit "
                        "the machine before launching them (default: on)")
    p.add_argument("--moe", default=None, choices=MOE_LAYOUTS,
                   help="mixture-of-experts layers: ep splits the experts over the --tp ranks of a stage (all-to-all "
                        "dispatch and combine), tp shards every expert like the dense MLP (default: ep; a model "
                        "without experts runs the same either way, and says so in a note when the flag is given)")


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
                        "one that moves fewer bytes; docs/decode.md; default: %(default)s)")
    # (RuntimeConfig.decode_buckets' rules, said in the flag's name)
    p.add_argument("--decode-buckets", type=int_list(1, hi=MAX_REQUESTS, increasing=True, most=MAX_DECODE_BUCKETS),
                   default=DEFAULT_DECODE_BUCKETS, metavar="N,N,...",
                   help="the decode batch sizes a decode graph is captured for (default: 1,2,4,...,64)")


def runtime_flag(field: str) -> str:
    """The flag that sets RuntimeConfig.``field`` (:func:`graphcp.jobs.preflight.job_spec`
    maps them): its name with dashes, but for the two named otherwise."""
    return {"collective_timeout_s": "--timeout", "microbatches": "--pp-microbatches"}.get(
        field, "--" + field.replace("_", "-"))


def graph_mode(args: argparse.Namespace) -> str:
    return args.graph or "breakable"
