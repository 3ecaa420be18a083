"""Host memory for in-memory snapshots: how many copies a rank holds, what each costs, that Ray is asked for it
with each rank's placement, and that a job no node can hold is refused on the field with a fix (no Ray)."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from orchestrator.planning import snapshot_memory as sm
from orchestrator.runtime.placement import rank_bundle


def _spec(parallel: dict, model: dict | None = None, **sections) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": "data/tiny"}, "parallel": parallel, "model": model or {}, **sections})


@pytest.mark.parametrize(("parallel", "sections", "held"), [
    ({"dp": 2}, {}, 2),  # mirrors: the peer's own snapshots are the replicas
    ({}, {}, 2),  # one rank: no peer to hold a replica
    ({"dp": 2, "zero": 1}, {}, 4),  # shards differ per rank: two replicas of the peer's arrive and stay
    ({"tp": 2}, {}, 4),
    ({"dp": 2, "grad_compression": "powersgd"}, {}, 4),  # error feedback is each rank's own
    ({"dp": 2, "dp_sync": "ps"}, {"parameter_server": {"consistency": "bsp"}}, 2),  # BSP ranks mirror
    ({"dp": 2}, {"checkpoint": {"memory_every": 0}}, 0),
])
def test_a_rank_holds_its_own_two_snapshots_and_two_of_its_peers_where_replicas_ship(parallel, sections, held):
    spec = _spec(parallel, **sections)
    assert sm.copies(spec) == held
    assert sm.host_bytes_per_rank(spec) == held * sm.snapshot_bytes(spec)


def test_each_ranks_placement_asks_ray_for_its_snapshots_memory():
    spec = _spec({"dp": 2, "zero": 1})
    assert rank_bundle(spec, use_gpu=True) == {"CPU": 1.0, "GPU": 1, "memory": sm.host_bytes_per_rank(spec)}
    assert "memory" not in rank_bundle(_spec({"dp": 2}, checkpoint={"memory_every": 0}), use_gpu=False)


def test_a_job_whose_snapshots_no_node_can_hold_is_refused_on_memory_every_with_a_fix():
    spec = _spec({"dp": 2, "tp": 2}, {"preset": "llama3-8b"})  # 12 bytes a parameter, over tp 2: ~48 GB a rank
    assert 45e9 < sm.snapshot_bytes(spec) < 50e9
    with pytest.raises(SpecError) as raised:
        sm.check_nodes(spec, [100e9, 150e9])
    err = raised.value
    assert (err.field, err.value) == ("checkpoint.memory_every", 1)
    assert "150.00 GB" in err.problem and "memory_every: 0" in err.fix
    sm.check_nodes(spec, [100e9, 200e9])  # a node holds the group's two ranks' two copies each
    sm.check_nodes(_spec({"dp": 2, "tp": 2}, {"preset": "llama3-8b"}, checkpoint={"memory_every": 0}), [1e9])
    assert "off" in sm.describe(_spec({"dp": 2}, checkpoint={"memory_every": 0}))
