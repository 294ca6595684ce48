"""A job's spec (model, runtime config, parallel degrees, buckets), the engine it opens
on a rank, and running a per-rank job ``fn(group, spec, ...)`` on every rank of the
spec: what the ``graphcp`` commands (prefill, run, profile) share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphcp.config import ParallelConfig, RuntimeConfig
from graphcp.dist import CPGroup, run_ranks
from graphcp.errors import GraphcpError, InputError, user_error
from graphcp.jobs.args import runtime_flag
from graphcp.kv.paged import KVCacheFull
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import PrefillEngine


@dataclass
class JobSpec:
    model: str = "default"
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    buckets_file: str | None = None
    cp_size: int = 1
    pp_size: int = 1
    pp_layers: tuple[int, ...] | None = None
    tp_size: int | None = None  # None: cp_size x dp_size
    dp_size: int = 1

    def buckets(self) -> BucketSet | None:
        return BucketSet.load(self.buckets_file) if self.buckets_file else None

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(cp_size=self.cp_size, pp_size=self.pp_size, pp_layers=self.pp_layers,
                              tp_size=self.tp_size, dp_size=self.dp_size)


def run_job_on_ranks(fn, spec: JobSpec, *args: Any) -> Any:
    """``fn(group, spec, *args)`` on every rank of ``spec``'s run (pp x tp ranks); rank 0's
    result. A cache too small for the job says which flag to raise."""
    try:
        return run_ranks(fn, spec.parallel.world_size, spec, *args, device=spec.runtime.device,
                         timeout_s=spec.runtime.collective_timeout_s)
    except GraphcpError as e:
        full = user_error(e)
        if isinstance(full, KVCacheFull) and full.setting is not None:
            named = InputError(full.naming(_given(spec.runtime, full.setting)))
            named.tracebacks = getattr(e, "tracebacks", None)  # --debug still shows the failing rank's
            raise named from e
        raise


def _given(rt: RuntimeConfig, field: str) -> str:
    """A runtime flag as given (``--kv-tokens (64)``), or by its name where it took the default."""
    value = getattr(rt, field)
    return runtime_flag(field) + (f" (given {value})" if value is not None else "")


def make_engine(group: CPGroup, spec: JobSpec, runtime: RuntimeConfig | None = None) -> PrefillEngine:
    return PrefillEngine(spec.model, runtime or spec.runtime, group, spec.buckets(), spec.parallel)
