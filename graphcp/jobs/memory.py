"""A rank's memory, estimated before any rank starts, and the check that a run's local
ranks fit the machine: ``prefill --cp 64`` on a 24 GiB machine used to run for minutes
until the kernel killed it. The estimate is rough on purpose (the order of magnitude
decides); ``--no-memory-check`` launches anyway."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from graphcp.errors import ConfigError
from graphcp.jobs.spec import JobSpec
from graphcp.model.config import ModelConfig
from graphcp.model.heads import head_shard, local_config
from graphcp.model.loader import model_on_meta
from graphcp.model.presets import resolve_model
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.pool_size import capture_bytes, pool_bytes, pool_pages

#: a rank's own process besides its tensors: the framework's heap and its collectives'
#: buffers on CPU (a forked CPU rank measured 300-400 MiB), the CUDA context on a GPU
PROCESS_BYTES = {"cpu": 384 << 20, "cuda": 1 << 30}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class RankMemory:
    """One rank's estimated bytes, by what holds them."""

    weights: int
    kv_pool: int
    graphs: int  # what the captured buckets keep
    activations: int  # one forward's working set
    process: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def __add__(self, other: "RankMemory") -> "RankMemory":
        return RankMemory(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def describe(self) -> str:
        parts = ", ".join(f"{f.name.replace('_', ' ')} {getattr(self, f.name) / 2**30:.2f}" for f in fields(self)
                          if getattr(self, f.name) >= 2**30 / 200)  # what rounds to 0.00 says nothing
        return f"{gib(self.total)}: {parts} GiB"


def row_bytes(cfg: ModelConfig, tp_size: int, itemsize: int) -> int:
    """A decoder layer's intermediates for one token row, roughly: the residual stream
    and norms, q/k/v before and after norm and RoPE, attention in and out, the MLP
    shard's gate, up and product."""
    attn = 4 * (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim + 2 * cfg.num_heads * cfg.head_dim
    return itemsize * (8 * cfg.hidden_size + attn + 5 * cfg.intermediate_size // tp_size)


def bucket_rows(spec: JobSpec, rows: int) -> int:
    """Rows of the bucket a forward of ``rows`` local rows replays (0: it runs eagerly)."""
    buckets = spec.buckets() or BucketSet()
    sel = buckets.select(rows)
    return sel.capacity if sel.graph else 0


def estimate_rank_memory(spec: JobSpec, rows: int, captured_rows: int, with_process: bool = True) -> RankMemory:
    """A rank of ``spec``'s run that prefills ``rows`` local rows a forward and has
    captured buckets of ``captured_rows`` rows in all (the largest rank of the largest
    stage). The CPU's trace graphs keep every intermediate of every captured bucket;
    CUDA graphs share one pool, the largest bucket's."""
    rt, par = spec.runtime, spec.parallel
    cfg = ModelConfig.from_file(resolve_model(spec.model) / "config.json")
    weights, stage_layers = 0, range(0)
    for stage in range(par.pp_size):
        model = model_on_meta(cfg, rt.torch_dtype, par, 0, stage, rt.moe)
        tensors = [*model.parameters(), *model.buffers()]  # the RoPE tables included
        weights = max(weights, sum(t.numel() * t.element_size() for t in tensors))
        stage_layers = max(stage_layers, model.stage.layers, key=len)
    if rt.draft is not None:  # an EAGLE-3 draft: its checkpoint, and one more cache layer (one stage only)
        weights += sum(f.stat().st_size for f in Path(rt.draft).glob("*.safetensors"))
        stage_layers = range(stage_layers.start, stage_layers.stop + 1)
    layers = len(stage_layers)
    # a rank's pool holds its own KV heads (attention TP)
    local = local_config(cfg, head_shard(cfg, par.attn_tp_size))
    pool = pool_bytes(local, rt, pool_pages(rt, cfg), stage_layers, 0,
                      par.cp_size)
    per_row = row_bytes(cfg, par.tp_size, rt.torch_dtype.itemsize)
    trace = rt.graph_backend == "trace" or (rt.graph_backend == "auto" and rt.device != "cuda")
    graphs = 0 if rt.graph == "off" else captured_rows * per_row * (layers if trace else 1)
    if rt.graph != "off":  # what the cache mode reserves at capture (pass-KV's staging: two layers of the pool)
        graphs += capture_bytes(local, rt, pool, layers)
    process = PROCESS_BYTES.get(rt.device, PROCESS_BYTES["cpu"]) if with_process else 0
    return RankMemory(weights, pool, graphs, rows * per_row, process)


def estimate_twin(spec: JobSpec, rows: int, dtype: str) -> RankMemory:
    """What a second engine of the same run in ``dtype`` adds (``graphcp run`` compares
    the other float dtype): its weights, pool and one captured bucket."""
    twin = replace(spec, runtime=replace(spec.runtime, dtype=dtype))
    return estimate_rank_memory(twin, rows, bucket_rows(twin, rows), with_process=False)


def job_memory(spec: JobSpec, forwards: Sequence[int], capture_all: bool = False,
               twin_dtype: str | None = None) -> RankMemory:
    """A rank of a job whose forwards prefill ``forwards`` tokens each (split over the
    CP ranks): it captures the buckets those rows need, or every bucket
    (``capture_all``, ``graphcp run``), and, with ``twin_dtype``, a second engine."""
    rows = [-(-n // spec.cp_size) for n in forwards if n > 0]
    if capture_all:
        captured = sum((spec.buckets() or BucketSet()).capacities)
    else:
        captured = sum({bucket_rows(spec, r) for r in rows})
    need = estimate_rank_memory(spec, max(rows), captured)
    return need + estimate_twin(spec, max(rows), twin_dtype) if twin_dtype is not None else need


def available_memory(device: str) -> tuple[int, str, int] | None:
    """(bytes available, what they are, how many devices the local ranks share), or
    None where it cannot be told."""
    if device == "cuda":
        return _gpu_free_memory()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory", 1
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory", 1
    except (AttributeError, ValueError, OSError):
        return None


def _gpu_free_memory() -> tuple[int, str, int] | None:
    """The least free memory of this process's GPUs, from nvidia-smi: asking CUDA would
    open a context on every GPU in the launching process, which then holds its memory
    for the whole run. None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        free = [int(x) << 20 for x in out.split()]  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(x.strip().isdigit() for x in visible.split(",") if x.strip()):
        free = [free[int(x)] for x in visible.split(",") if x.strip() and int(x) < len(free)]
    return (min(free), "free memory of a GPU", len(free)) if free else None


def check_local_ranks_fit(spec: JobSpec, need: RankMemory, available: tuple[int, str, int] | None = None) -> None:
    """Refuse, before launching, local ranks whose estimated memory exceeds what the
    machine has (one GPU a rank, round robin, on CUDA; every rank in host memory on CPU).
    Under torchrun each process is one rank of a launcher's choosing: not checked."""
    if "WORLD_SIZE" in os.environ:
        return
    available = available if available is not None else available_memory(spec.runtime.device)
    if available is None:
        return
    have, what, devices = available
    world = spec.parallel.world_size
    ranks = -(-world // devices)  # the most ranks one device holds
    if ranks * need.total <= have:
        return
    degrees = f"--cp {spec.cp_size}" + (f" --pp {spec.pp_size}" if spec.pp_size > 1 else "")
    share = (f"{ranks} ranks" if ranks > 1 else "1 rank") \
        + (f" on a GPU ({world} on {devices})" if devices > 1 else "") \
        + (" need" if ranks > 1 else " needs")
    raise ConfigError(f"{degrees}: {share} about {gib(ranks * need.total)} (a rank, estimated, "
                      f"{need.describe()}), more than the {gib(have)} of {what}; lower --cp or --kv-tokens, "
                      "or pass --no-memory-check to launch anyway")
