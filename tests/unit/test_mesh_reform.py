"""A process that leaves its group and joins a new one computes on the new group's mesh, never the old one's.

What a Ray survivor does when the controller re-forms a failed group, and what the parity harness does for
several jobs in one spawn. Four gloo ranks build a cp=2 x tp=2 mesh (``init_mesh``), run a DTensor op on
its tp dim, leave the group, then build a pp=2 x tp=2 mesh and run the same op: the two tp meshes are equal
by ``DeviceMesh.__eq__`` (same ranks and layout) but their process groups have other names, so an op whose
sharding DTensor had cached from the first job handed back the first mesh, and the gather below failed with
"Could not resolve the process group registered under the name N" (``process_group.forget_previous_meshes``).
"""

from __future__ import annotations

from tests.support.parity_harness import rank_ports, spawn_ranks
from workers.contract.grid import Grid

WORLD = 4
GRIDS = (Grid(cp=2, tp=2), Grid(pp=2, tp=2))  # the first creates more groups before tp: other tp group names


def _doubled_gather(mesh):
    """A tp-sharded tensor doubled (through DTensor's sharding propagation), gathered over the tp group;
    with the group names the result's mesh carries and those of the mesh it was made on."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    tp = mesh["tp"]
    doubled = distribute_tensor(torch.arange(8.0).reshape(4, 2), tp, [Shard(0)]) * 2
    return doubled.full_tensor().tolist(), (doubled.device_mesh.get_group().group_name, tp.get_group().group_name)


def _rank(rank: int, ports, results) -> None:
    import torch
    import torch.distributed as dist

    from workers.parallel.process_group import init_mesh

    out = []
    for i, grid in enumerate(GRIDS):
        port, listener = ports.join(rank, i)
        mesh = init_mesh(rank, WORLD, "127.0.0.1", port, grid, torch.device("cpu"), timeout_s=60, listener=listener)
        out.append(_doubled_gather(mesh))
        dist.destroy_process_group()
    results.put((rank, out))


def test_an_op_after_the_group_is_reformed_runs_on_the_new_mesh():
    by_rank = spawn_ranks(_rank, (rank_ports(len(GRIDS)),), WORLD, timeout_s=120)
    expected = [[2.0 * (2 * row + col) for col in range(2)] for row in range(4)]
    for rank, jobs in by_rank.items():
        for (gathered, (result_groups, mesh_groups)), grid in zip(jobs, GRIDS, strict=True):
            assert gathered == expected, (rank, grid)
            assert result_groups == mesh_groups, (rank, grid)
