"""The two-dimensional mesh of a pipeline stage and its named process groups.

A stage holds T = ``tp_size`` ranks in SGLang's order (dp, cp, attn_tp), attention TP
fastest: stage-local rank ``i = (d * C + c) * A + a`` with A = T / (D x C). Global rank
``s * T + i`` (stage-major). With T = 4, C = 2: attention-TP groups {0, 1}, {2, 3}; CP
groups {0, 2}, {1, 3}. The groups, named by what they do:

- ``attn_tp``: the A ranks that split one CP partition's heads (o_proj partial sums);
- ``cp``: the C ranks of one head shard in one replica (the layout, the KV all-gather,
  the rings);
- ``dp``: the D replicas' ranks at the same (cp, attn_tp) coordinates;
- ``ffn``: all T ranks of the stage (the dense MLP's TP, the MoE's ep and tp).

:func:`rank_groups` is the pure rank -> members table; :func:`build_mesh` creates the
process groups once (every rank calls it: creating a group is collective).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from graphcp.config import ParallelConfig
from graphcp.dist import CPGroup, new_subgroups

GROUP_NAMES = ("attn_tp", "cp", "dp", "ffn")


@dataclass(frozen=True)
class MeshCoords:
    """One rank's place in the mesh."""

    stage: int
    dp: int
    cp: int
    attn_tp: int

    def as_dict(self) -> dict[str, int]:
        return {"stage": self.stage, "dp": self.dp, "cp": self.cp, "attn_tp": self.attn_tp}


def mesh_shape(parallel: ParallelConfig) -> tuple[int, int, int, int]:
    """(P, D, C, A)."""
    return parallel.pp_size, parallel.dp_size, parallel.cp_size, parallel.attn_tp_size


def coords(rank: int, parallel: ParallelConfig) -> MeshCoords:
    """A global rank's (stage, dp, cp, attn_tp)."""
    _, _, C, A = mesh_shape(parallel)
    stage, i = divmod(rank, parallel.tp_size)
    d, rest = divmod(i, C * A)
    c, a = divmod(rest, A)
    return MeshCoords(stage, d, c, a)


def global_rank(parallel: ParallelConfig, stage: int, dp: int, cp: int, attn_tp: int) -> int:
    _, _, C, A = mesh_shape(parallel)
    return stage * parallel.tp_size + (dp * C + cp) * A + attn_tp


def all_groups(parallel: ParallelConfig) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of global ranks (the same lists on every rank,
    in the order they are created)."""
    P, D, C, A = mesh_shape(parallel)
    g = lambda s, d, c, a: global_rank(parallel, s, d, c, a)
    return {
        "attn_tp": [[g(s, d, c, a) for a in range(A)] for s in range(P) for d in range(D) for c in range(C)],
        "cp": [[g(s, d, c, a) for c in range(C)] for s in range(P) for d in range(D) for a in range(A)],
        "dp": [[g(s, d, c, a) for d in range(D)] for s in range(P) for c in range(C) for a in range(A)],
        "ffn": [[s * parallel.tp_size + i for i in range(parallel.tp_size)] for s in range(P)],
    }


def rank_groups(rank: int, parallel: ParallelConfig) -> dict[str, list[int]]:
    """The members (global ranks) of each named group ``rank`` belongs to."""
    return {name: next(m for m in groups if rank in m) for name, groups in all_groups(parallel).items()}


@dataclass
class MeshGroups:
    """This rank's groups (size-1 groups where a degree is 1: their collectives are
    no-ops) and its coordinates."""

    coords: MeshCoords
    attn_tp: CPGroup
    cp: CPGroup
    dp: CPGroup
    ffn: CPGroup

    def describe(self) -> dict[str, list[int]]:
        """Each group's size and this rank's place in it (for stats and tests)."""
        return {n: [getattr(self, n).rank, getattr(self, n).size] for n in GROUP_NAMES}


def _single(world: CPGroup, name: str) -> CPGroup:
    return CPGroup(0, 1, None, world.timeout_s, name, world.rank)


def build_mesh(world: CPGroup, parallel: ParallelConfig, stage_group: CPGroup | None = None) -> MeshGroups:
    """The named groups of this rank. ``world``: every rank of the run (global ranks);
    ``stage_group``: this rank's stage (all T ranks), reused as the FFN group and, when
    attention TP and DP are 1, as the CP group, so a run without the mesh creates no
    process group it did not create before."""
    me = coords(world.rank, parallel)
    stage_group = stage_group if stage_group is not None else world
    ffn = replace(stage_group, name="FFN group" if parallel.pp_size == 1 else f"FFN group of stage {me.stage}")
    groups = all_groups(parallel)
    _, D, C, A = mesh_shape(parallel)
    if A == 1 and D == 1:
        return MeshGroups(me, _single(world, "attention-TP group"), stage_group, _single(world, "DP group"), ffn)
    made = {}
    for name, label in (("attn_tp", "attention-TP group {index}"), ("cp", "CP group {index}"),
                        ("dp", "DP group {index}")):
        size = {"attn_tp": A, "cp": C, "dp": D}[name]
        made[name] = new_subgroups(world, groups[name], label) if size > 1 else _single(world, label.format(
            index=groups[name].index(rank_groups(world.rank, parallel)[name])))
    return MeshGroups(me, made["attn_tp"], made["cp"], made["dp"], ffn)
