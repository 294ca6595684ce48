"""The mesh (ParallelConfig's tp/cp/dp/pp degrees) and its named process groups: the
rank -> groups table for (T, C, D) = (4, 2, 1) and (8, 2, 2) against SGLang's order
((dp, cp, attn_tp), attention TP fastest), the groups built on 4 gloo ranks, and the
degrees refused with one-line errors that name the degree to change."""

from __future__ import annotations

import pytest
import torch

from graphcp import ConfigError, ParallelConfig
from graphcp.combinations import parallel_settings, refusal
from graphcp.dist import launch
from graphcp.mesh import GROUP_NAMES, build_mesh, coords, rank_groups

#: (T, C, D) = (4, 2, 1): attention TP 2 inside each of the 2 CP partitions
TABLE_421 = {
    0: {"attn_tp": [0, 1], "cp": [0, 2], "dp": [0], "ffn": [0, 1, 2, 3]},
    1: {"attn_tp": [0, 1], "cp": [1, 3], "dp": [1], "ffn": [0, 1, 2, 3]},
    2: {"attn_tp": [2, 3], "cp": [0, 2], "dp": [2], "ffn": [0, 1, 2, 3]},
    3: {"attn_tp": [2, 3], "cp": [1, 3], "dp": [3], "ffn": [0, 1, 2, 3]},
}


def test_degrees_and_defaults():
    p = ParallelConfig(cp_size=2)
    assert (p.tp_size, p.attn_tp_size, p.world_size) == (2, 1, 2)  # every existing config means the same
    p = ParallelConfig(tp_size=4, cp_size=2)
    assert (p.attn_tp_size, p.world_size) == (2, 4)
    assert ParallelConfig(tp_size=8, cp_size=2, dp_size=2, pp_size=2).world_size == 16
    assert ParallelConfig(cp_size=2, dp_size=2).tp_size == 4


@pytest.mark.parametrize("kw, msg", [
    (dict(tp_size=3, cp_size=2), r"tp_size=3 must be a multiple of dp_size x cp_size = 1 x 2 = 2 .*change tp_size"),
    (dict(tp_size=4, cp_size=4, dp_size=2), r"tp_size=4 must be a multiple of dp_size x cp_size = 2 x 4 = 8"),
    (dict(tp_size=0), r"tp_size must be >= 1, got 0"),
    (dict(dp_size=0), r"dp_size must be >= 1, got 0"),
])
def test_degrees_that_do_not_divide_are_refused(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ParallelConfig(**kw)


def test_membership_table_421():
    p = ParallelConfig(tp_size=4, cp_size=2)
    for rank, want in TABLE_421.items():
        assert rank_groups(rank, p) == want
    assert [coords(r, p).as_dict() for r in range(4)] == [
        {"stage": 0, "dp": 0, "cp": c, "attn_tp": a} for c in range(2) for a in range(2)]


def test_membership_table_822():
    """T = 8, C = 2, D = 2: attention TP 2; rank (d, c, a) = 4 d + 2 c + a."""
    p = ParallelConfig(tp_size=8, cp_size=2, dp_size=2)
    for rank in range(8):
        d, c, a = rank // 4, rank // 2 % 2, rank % 2
        assert coords(rank, p).as_dict() == {"stage": 0, "dp": d, "cp": c, "attn_tp": a}
        assert rank_groups(rank, p) == {
            "attn_tp": [4 * d + 2 * c, 4 * d + 2 * c + 1],
            "cp": [4 * d + a, 4 * d + 2 + a],
            "dp": [2 * c + a, 4 + 2 * c + a],
            "ffn": list(range(8)),
        }
    # under two pipeline stages each stage holds the same mesh, 8 ranks on
    p2 = ParallelConfig(tp_size=8, cp_size=2, dp_size=2, pp_size=2)
    assert rank_groups(13, p2) == {k: [r + 8 for r in v] for k, v in rank_groups(5, p).items()}


def test_every_mesh_combines():
    def refused(p: ParallelConfig):
        return refusal(parallel_settings(p))

    assert refused(ParallelConfig(tp_size=4, cp_size=2)) is None
    assert refused(ParallelConfig(cp_size=2, dp_size=2)) is None
    # attention DP under pipeline stages: tests/test_decode_dp.py
    assert refused(ParallelConfig(tp_size=4, cp_size=2, dp_size=2, pp_size=2)) is None
    assert refused(ParallelConfig(tp_size=4, cp_size=2, pp_size=2)) is None  # each stage holds the mesh


def _members(world, tp: int, cp: int):
    mesh = build_mesh(world, ParallelConfig(tp_size=tp, cp_size=cp))
    me = torch.tensor([world.rank])
    return {name: getattr(mesh, name).all_gather_rows(me).tolist() for name in GROUP_NAMES}, mesh.describe()


def test_groups_built_on_four_ranks_match_the_table():
    """Each named group's all-gather of the global ranks lists exactly the table's members."""
    for rank, (members, where) in enumerate(launch(_members, 4, 4, 2, timeout_s=60)):
        assert members == TABLE_421[rank], rank
        assert where == {"attn_tp": [rank % 2, 2], "cp": [rank // 2, 2], "dp": [0, 1], "ffn": [rank, 4]}
