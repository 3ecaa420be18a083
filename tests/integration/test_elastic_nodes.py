"""Automatic elastic data parallelism on a real multi-node cluster: a node is lost, the job shrinks, a node
comes back, the job grows again, and the loss curve is the uninterrupted single-process reference's. A node
Ray drains (a spot reclaim's notice) has its rank saved and moved off it before it goes."""

from __future__ import annotations

import pytest

from orchestrator import JobSpec, TrainingJob
from orchestrator.errors import SpecError
from tests.support.elastic_cluster import run_on_cluster
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import reference_losses

STEPS = 12
DRAIN_STEPS = 20
# hang_floor_s: these tests slow rank 0 so the job outlasts a node's start; on a loaded machine its slowed steps
# passed the 5 s default floor and were taken for a hang, a second recovery the tests do not expect
ELASTIC = {"heartbeat_timeout_s": 60, "collective_timeout_s": 5, "placement_timeout_s": 8, "grow_check_s": 1,
           "hang_floor_s": 30}


def elastic_spec(token_data, tmp_path, faults, **ft) -> JobSpec:
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2}, train={"steps": STEPS},
                     checkpoint={"memory_every": 1}, fault_tolerance={**ELASTIC, **ft})
    return JobSpec.from_dict({**spec.to_dict(), "faults": faults})


def test_lost_node_shrinks_data_parallelism_and_a_new_node_grows_it_back(token_data, tmp_path):
    expected = reference_losses(tiny_spec(token_data, tmp_path / "ref", train={"steps": STEPS}), STEPS)
    # two 1-CPU nodes: one data replica each. Rank 1's node is lost at step 4; rank 0 is slowed from then on
    # so the job is still running when the node added after the shrink has joined.
    faults = [{"kind": "kill_node", "rank": 1, "at_step": 4}, {"kind": "slow_rank", "rank": 0, "at_step": 4,
                                                                "factor": 6}]
    out = run_on_cluster(elastic_spec(token_data, tmp_path, faults), tmp_path, "--nodes", "2", "--cpus", "1",
                         "--add-node-after-shrink")
    assert "error" not in out, out.get("error")
    result = out["result"]
    (rec,) = result["recoveries"]
    assert (rec["kind"], rec["rank"], rec["at_step"], rec["dp_from"], rec["dp_to"]) == ("node", 1, 4, 2, 1)
    assert rec["source"] == "memory" and rec["lost_steps"] == 0 and rec["mttr_s"] > 0
    assert out["dead_nodes"] == [rec["identities_before"]["1"]["node_id"]]  # rank 1's node, and only it, is gone
    shrink, grow = result["resizes"]
    assert (shrink["reason"], shrink["dp_from"], shrink["dp_to"], shrink["microbatches"]) == ("shrink", 2, 1, 4)
    assert (grow["reason"], grow["dp_from"], grow["dp_to"], grow["microbatches"]) == ("grow", 1, 2, 2)
    assert shrink["at_step"] == 3 and 3 <= grow["at_step"] < STEPS
    assert result["layout"]["dp"] == 2
    # every step once, each on the uninterrupted reference curve: the global batch and the data order held
    assert result["steps"] == STEPS
    assert result["losses"] == pytest.approx(expected, rel=1e-4)


def test_shrinking_below_min_dp_fails_naming_the_field(token_data, tmp_path):
    faults = [{"kind": "kill_node", "rank": 1, "at_step": 3}]
    out = run_on_cluster(elastic_spec(token_data, tmp_path, faults, min_dp=2), tmp_path, "--nodes", "2", "--cpus", "1")
    assert "fault_tolerance.min_dp=2" in out["error"] and "dp=1" in out["error"] and "fix:" in out["error"]


def test_kill_node_on_the_drivers_node_is_refused_before_training(ray_cluster, token_data, tmp_path):
    spec = elastic_spec(token_data, tmp_path, [{"kind": "kill_node", "rank": 1, "at_step": 3}])
    with pytest.raises(SpecError, match=r"faults.0.rank.*placed on the head node, where the driver runs.*fix:"):
        TrainingJob(spec, progress=False).run()


def test_min_dp_above_dp_is_refused_naming_field_value_and_fix(token_data, tmp_path):
    with pytest.raises(SpecError, match=r"`fault_tolerance.min_dp`: value 3 is above parallel.dp=2.*fix: set min_dp"):
        elastic_spec(token_data, tmp_path, [], min_dp=3)


def test_a_drained_node_has_its_rank_saved_and_moved_to_another_node_bit_identical(token_data, tmp_path):
    """Three 1-CPU nodes, dp=2: once step 3 is shown, rank 1's node is drained through ``ray drain-node`` (reason
    preemption, token auth on). The controller hears it from Ray, rank 0 ends the window at the next boundary
    with that step checkpointed, rank 1 goes and comes back on the third node (its placement group reserved again
    without the drained one), and once recovered the drained node is taken down, which the job no longer
    notices: one recovery, nothing lost, the losses equal the uninterrupted run's bit for bit (issue 51)."""
    # the job outlasts the drain CLI's start (2-3 s, more on a loaded machine): rank 0's steps from step 3 on take
    # 10 times as long (about 0.35 s), so the 17 left last twice that or more (at factor 4 a loaded full suite once
    # ran them in 2 s, before the drain was seen); ELASTIC's hang floor keeps them from being taken for a hang
    slow = [{"kind": "slow_rank", "rank": 0, "at_step": 3, "factor": 10}]
    spec = drain_spec(token_data, tmp_path, slow)
    out = run_on_cluster(spec, tmp_path, "--nodes", "3", "--cpus", "1", "--drain-rank", "1", "--drain-at", "3")
    assert "error" not in out, out.get("error")
    result, drained = out["result"], out["drained_node"]
    (rec,) = result["recoveries"]
    assert (rec["kind"], rec["rank"], rec["node"], rec["lost_steps"]) == ("drain", 1, drained, 0), rec
    before = {int(r): identity["node_id"] for r, identity in rec["identities_before"].items()}
    after = {r["rank"]: r["node_id"] for r in result["layout"]["ranks"]}
    assert before[1] == drained and after[1] not in (drained, before[0]) and after[0] == before[0]
    assert out.get("removed_drained_node") and out["dead_nodes"] == [drained]
    saved = rec["at_step"] - 1  # the just-in-time checkpoint of the step the window ended at (every: 50)
    assert 3 <= saved < DRAIN_STEPS and any(path.endswith(f"{saved:08d}") for path in result["checkpoints"])
    straight = ran(run_grouped({"dp2": drain_spec(token_data, tmp_path / "straight", [])}), "dp2")
    assert result["steps"] == DRAIN_STEPS and result["losses"] == straight.losses


def drain_spec(token_data, tmp_path, faults) -> JobSpec:
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2}, train={"steps": DRAIN_STEPS},
                     checkpoint={"memory_every": 1},
                     # the rendezvous waits collective_timeout_s for the moved rank, whose new process starts on a
                     # fresh node: 5 s was too short on a loaded machine ("1/2 clients joined")
                     fault_tolerance={**ELASTIC, "placement_timeout_s": 60, "collective_timeout_s": 30})
    return JobSpec.from_dict({**spec.to_dict(), "faults": faults})
