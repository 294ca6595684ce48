"""Point-to-point transfers over a sub-group name its peers in the sub-group's own ranks
(``CPGroup.send_recv``, the ring's step): torch's ``P2POp`` takes a *global* peer even
with ``group=``, so the group must translate. On gloo, world 4 split into {0, 1} and
{2, 3}: in the second, group ranks 0/1 are global ranks 2/3."""

from __future__ import annotations

import pytest
import torch

from graphcp.dist import launch, new_subgroups

DTYPES = [torch.float32, torch.bfloat16]


def _ring_step(world, dtype_name: str):
    group = new_subgroups(world, [[0, 1], [2, 3]], "CP group {index}")
    dtype = getattr(torch, dtype_name)
    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    # a payload only this global rank sends: 1/3 steps are exact in float32, rounded in bfloat16
    send = (torch.arange(6, dtype=torch.float32) / 3 + 10 * world.rank).to(dtype)
    recv = torch.full((6,), float("nan"), dtype=dtype)
    group.send_recv(send, nxt, recv, prv).wait()
    return group.rank, group.global_rank, recv


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_send_recv_on_a_subgroup_reaches_the_group_neighbours(dtype):
    results = launch(_ring_step, 4, str(dtype).removeprefix("torch."), timeout_s=60)
    for world_rank, (rank, global_rank, recv) in enumerate(results):
        assert global_rank == world_rank and rank == world_rank % 2
        sender = world_rank ^ 1  # the other member of this rank's pair: its ring neighbour both ways
        want = (torch.arange(6, dtype=torch.float32) / 3 + 10 * sender).to(dtype)
        assert recv.dtype == dtype and torch.equal(recv, want), (world_rank, recv, want)


def _host_group_of_an_nccl_pair(world):
    """World 4 split into pairs; the pairs' groups reported as NCCL: host_group makes a gloo
    group of the same ranks (its members alone), which gathers host tensors."""
    import torch.distributed as dist

    from graphcp import dist as gdist

    group = new_subgroups(world, [[0, 1], [2, 3]], "CP group {index}")
    real = dist.get_backend
    gdist.dist.get_backend = lambda pg=None: "nccl" if pg is group.pg else real(pg)
    try:
        host = gdist.host_group(group)
    finally:
        gdist.dist.get_backend = real
    rows = host.all_gather_rows(torch.tensor([[world.rank]], dtype=torch.int64))
    return (host is not group, real(host.pg), dist.get_process_group_ranks(host.pg), host.timeout_s == group.timeout_s,
            host.name, rows.flatten().tolist(), gdist.host_group(world) is world)


def test_the_host_group_of_an_nccl_group_is_a_gloo_group_of_its_ranks():
    """A decode step's fingerprint goes over it (graphcp.runtime.decode.plan): host memory,
    no device sync. A gloo group is its own host group."""
    for world_rank, (new, backend, ranks, same_timeout, name, rows, own) in enumerate(
            launch(_host_group_of_an_nccl_pair, 4, timeout_s=60)):
        pair = [0, 1] if world_rank < 2 else [2, 3]
        assert new and backend == "gloo" and ranks == pair and same_timeout and name.endswith("(gloo)")
        assert rows == pair and own
