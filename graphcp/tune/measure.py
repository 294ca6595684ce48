"""``graphcp tune --measure``: capture a bucket set with the real runner on this
device (the trace backend on CPU, CUDA graphs on a GPU) and record per-bucket
capture time and, on CUDA, graph-pool memory."""

from __future__ import annotations

from graphcp.config import RuntimeConfig
from graphcp.dist import CPGroup, run_ranks
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import PrefillEngine


def _capture_job(group: CPGroup, model: str, runtime: RuntimeConfig, buckets: BucketSet) -> list[dict] | None:
    # the tuned file's cp/layout are checked by the engine; measure the capacities as given
    engine = PrefillEngine(model, runtime, group, BucketSet(buckets.capacities, buckets.align,
                                                            buckets.padding_factor))
    stats = engine.capture(progress=group.rank == 0)
    if group.rank != 0:
        return None
    return [{"capacity": s.capacity, "capture_s": s.capture_s, "pool_bytes": s.pool_bytes,
             "segments": s.segments, "breaks": s.breaks} for s in sorted(stats, key=lambda s: s.capacity)]


def measure_capture(
    bucket_set: BucketSet, cp_size: int, model: str = "default", device: str = "cpu", dtype: str = "float32"
) -> list[dict]:
    """Capture every bucket of ``bucket_set`` on ``cp_size`` ranks; one dict a bucket."""
    rt = RuntimeConfig(dtype=dtype, device=device, graph="breakable", layout="zigzag",
                       kv_tokens=max(8192, cp_size * bucket_set.largest))
    return run_ranks(_capture_job, cp_size, model, rt, bucket_set, device=device)
