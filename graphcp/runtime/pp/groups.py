"""The process groups of a pipeline: ranks are stage-major (global rank
``s * tp_size + r`` is rank ``r`` of stage ``s``; tp_size = cp_size without attention
TP); each stage is a group of tp_size ranks holding the mesh (graphcp.mesh), and rank
``(s, r)`` hands its CP-local hidden rows to ``(s + 1, r)`` point to point (an
attention-TP rank hands the same rows as the others of its CP partition)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from graphcp.config import ParallelConfig
from graphcp.dist import CPGroup, PeerLink, new_subgroups
from graphcp.errors import ConfigError


@dataclass
class PipelineGroups:
    world: CPGroup  # every rank of the pipeline (the output broadcasts)
    cp: CPGroup  # this rank's stage: all its tp_size ranks (the CP group without attention TP)
    stage: int
    num_stages: int
    prev: PeerLink | None  # from (stage - 1, same CP rank); None on the first stage
    next: PeerLink | None  # to (stage + 1, same CP rank); None on the last stage

    def stage_root(self, stage: int) -> int:
        """The global rank of rank 0 of ``stage`` (the source of its broadcasts)."""
        return stage * self.cp.size

    def broadcast(self, x: torch.Tensor, stage: int, device: torch.device) -> torch.Tensor:
        """A host tensor from rank 0 of ``stage`` to every rank of the pipeline (through the
        device: NCCL moves device memory only); on the host."""
        return self.world.broadcast_(x.to(device), self.stage_root(stage)).cpu()


def pipeline_groups(world: CPGroup, parallel: ParallelConfig) -> PipelineGroups:
    """Build the stage groups and links (every rank of ``world`` calls it: creating a
    sub-group is collective)."""
    P, C = parallel.pp_size, parallel.tp_size
    if world.size != P * C:
        degree = f"cp_size={C}" if C == parallel.cp_size else f"tp_size={C}"
        raise ConfigError(f"ParallelConfig pp_size={P} x {degree} needs {P * C} ranks, the process group has "
                          f"{world.size}")
    world = replace(world, name="pipeline (every stage)", global_rank=None)
    stage, r = divmod(world.rank, C)
    name = "CP group of stage {index}" if C == parallel.cp_size else "group of stage {index}"
    cp = new_subgroups(world, [[s * C + i for i in range(C)] for s in range(P)], name)

    def link(s: int) -> PeerLink | None:
        if not 0 <= s < P:
            return None
        peer = s * C + r
        return PeerLink(world.rank, peer, world.timeout_s, f"stage {s} (global rank {peer})")

    return PipelineGroups(world, cp, stage, P, link(stage - 1), link(stage + 1))
