"""The process groups of a pipeline: ranks are stage-major (global rank
``s * cp_size + r`` is CP rank ``r`` of stage ``s``); each stage is a CP group, and
rank ``(s, r)`` hands its CP-local hidden rows to ``(s + 1, r)`` point to point."""

from __future__ import annotations

from dataclasses import dataclass, replace

from graphcp.config import ParallelConfig
from graphcp.dist import CPGroup, PeerLink, new_subgroups
from graphcp.errors import ConfigError


@dataclass
class PipelineGroups:
    world: CPGroup  # every rank of the pipeline (the output broadcasts)
    cp: CPGroup  # this rank's stage: its CP group
    stage: int
    num_stages: int
    prev: PeerLink | None  # from (stage - 1, same CP rank); None on the first stage
    next: PeerLink | None  # to (stage + 1, same CP rank); None on the last stage

    def stage_root(self, stage: int) -> int:
        """The global rank of CP rank 0 of ``stage`` (the source of its broadcasts)."""
        return stage * self.cp.size


def pipeline_groups(world: CPGroup, parallel: ParallelConfig) -> PipelineGroups:
    """Build the stage groups and links (every rank of ``world`` calls it: creating a
    sub-group is collective)."""
    P, C = parallel.pp_size, parallel.cp_size
    if world.size != P * C:
        raise ConfigError(f"ParallelConfig pp_size={P} x cp_size={C} needs {P * C} ranks, the process group has "
                          f"{world.size}")
    world = replace(world, name="pipeline (every stage)", global_rank=None)
    stage, r = divmod(world.rank, C)
    cp = new_subgroups(world, [[s * C + i for i in range(C)] for s in range(P)], "CP group of stage {index}")

    def link(s: int) -> PeerLink | None:
        if not 0 <= s < P:
            return None
        peer = s * C + r
        return PeerLink(world.rank, peer, world.timeout_s, f"stage {s} (global rank {peer})")

    return PipelineGroups(world, cp, stage, P, link(stage - 1), link(stage + 1))
