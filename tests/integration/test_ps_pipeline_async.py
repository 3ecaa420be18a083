"""Parameter-server asp/ssp across pipeline stages, and fp16 under them, on pp=2 x dp=2.

SSP with bound 0 reads every earlier push, and reproduces BSP where no read saw a faster replica's push of its own
clock (with the one shard optimizer for which a push applied on arrival is the same update as BSP's averaged one:
SGD, no weight decay, no clipping). Under a straggler every stage's reads stay
within the bound, from the shards' own per-stage counts, while fp16 steps that overflow are skipped by the
replica that overflowed and the loss scaler backs off until the replica trains. A rank killed under ssp is taken
over: its replica's stages redo the lost step together, the other replica's do not wait for it.
"""

from __future__ import annotations

import json
import math

import pytest

from orchestrator import JobSpec, TrainingJob
from tests.support.jobs import tiny_spec

STEPS = 3
LINEAR = {"name": "sgd", "lr": 0.05, "weight_decay": 0.0, "momentum": 0.0, "grad_clip": 0.0}
FP16_SCALE = 2.0 ** 20  # the tiny model overflows fp16 in its first steps at this loss scale (halved each)


def _pp_dp(token_data, tmp_path, consistency: str, steps: int = STEPS, faults=(), **sections) -> JobSpec:
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2, "pp": 2, "dp_sync": "ps"}, train={"steps": steps},
                     parameter_server={"shards": 2, "consistency": consistency,
                                       **({"staleness": 0} if consistency == "ssp" else {})},  # only ssp reads it
                     checkpoint={"memory_every": 0}, **sections)
    return JobSpec.from_dict({**spec.to_dict(), "faults": list(faults)})


@pytest.fixture(scope="module")
def bsp_linear(ray_cluster, token_data, tmp_path_factory):
    spec = _pp_dp(token_data, tmp_path_factory.mktemp("bsp"), "bsp", optim=LINEAR)
    return TrainingJob(spec, progress=False).run()


def test_ssp_with_bound_zero_reads_every_earlier_push_and_is_bsp_when_no_read_ran_ahead(bsp_linear, token_data,
                                                                                       tmp_path):
    """Bound 0: a replica's step c starts only once every replica's step c - 1 is on the shards, per stage, so
    every read at clock c has every push of clocks < c in (the shards' read log). SSP bounds staleness, not
    freshness: a faster replica's push of clock c may already be in when the slower one reads (it was, in one CI
    run). Where no read ran ahead, each read is BSP's weights, and the two pushes of a step, each applied on
    arrival at half weight, are BSP's one averaged SGD step up to rounding."""
    spec = _pp_dp(token_data, tmp_path, "ssp", optim=LINEAR)
    result = TrainingJob(spec, progress=False).run()
    assert result.steps == STEPS
    reads = [json.loads(line) for line in (spec.resolved_run_dir() / "ps_reads.jsonl").read_text().splitlines()]
    assert len({(r["worker"], r["clock"]) for r in reads}) == 2 * 2 * STEPS  # every worker read at every clock
    assert all(r["min_applied"] >= r["clock"] for r in reads)
    if all(r["max_applied"] == r["clock"] for r in reads):
        assert result.losses == pytest.approx(bsp_linear.losses, rel=1e-6, abs=0)
    else:  # some reads had half a step more: not BSP's losses, but a step of the same training
        assert result.losses == pytest.approx(bsp_linear.losses, rel=1e-2, abs=0)
    assert result.losses[-1] < result.losses[0]


def test_ssp_bound_holds_per_stage_under_a_straggler_with_fp16_overflows(token_data, tmp_path):
    """Replica 1's last stage (rank 3) runs 3x slow from step 1; staleness 1; fp16 at a loss scale that overflows
    the first steps. Each stage's reads, from the shards' own count of that stage's pushes, stay within the bound
    and replica 0 really runs a step ahead in both stages; a replica's two stages read at the same clocks (the
    pipeline keeps them together); the overflowed steps are skipped (no grad norm) and a later one trains."""
    slow = {"kind": "slow_rank", "rank": 3, "at_step": 1, "factor": 3.0}
    spec = _pp_dp(token_data, tmp_path, "ssp", steps=4, faults=[slow],
                  precision={"dtype": "fp16", "initial_loss_scale": FP16_SCALE})
    spec = spec.with_overrides(["parameter_server.staleness=1"])
    result = TrainingJob(spec, progress=False).run()
    reads = [json.loads(line) for line in (spec.resolved_run_dir() / "ps_reads.jsonl").read_text().splitlines()]
    for stage in (0, 1):
        gaps = [r["clock"] - r["min_applied"] for r in reads if r["stage"] == stage]
        assert gaps and max(gaps) == 1, (stage, gaps)  # within the bound, and the straggler let replica 0 run ahead
    clocks = {(r["stage"], r["worker"] % 2): {r["clock"] for r in reads if r["worker"] == w}
              for w in range(4) for r in reads if r["worker"] == w}
    for replica in (0, 1):
        assert clocks[0, replica] == clocks[1, replica], replica
    # rank 0's first steps overflowed (no grad norm), and with its scale backed off a later one trained
    assert math.isnan(result.grad_norms[0]) and any(math.isfinite(n) for n in result.grad_norms), result.grad_norms
    assert all(math.isfinite(loss) for loss in result.losses)


def test_ssp_recovers_a_killed_last_stage_rank_with_every_stage_at_its_clock(token_data, tmp_path):
    """Rank 1 (replica 0's last stage) dies in step 3. Its replica's stage 0 is set back with it and both redo the
    step; replica 1 finishes its step in flight. This drill once hung intermittently: the other replica's stage lost
    a shard call to a connection Ray dropped as the rank died, marked both holders down, and its step was never
    ticked nor given up. Each stage's reads stay within the bound, no worker's clock skips one, and the run's
    budget of worker steps is done exactly (the lost step once again)."""
    kill = {"kind": "kill_rank", "rank": 1, "at_step": 3}
    spec = _pp_dp(token_data, tmp_path, "ssp", steps=5, faults=[kill]).with_overrides(
        ["parameter_server.staleness=1", "fault_tolerance.heartbeat_timeout_s=20",
         "fault_tolerance.collective_timeout_s=5"])
    result = TrainingJob(spec, progress=False).run()
    assert result.status == "finished" and result.steps == 5
    [rec] = result.recoveries
    assert (rec["kind"], rec["rank"], rec["source"], rec["lost_steps"]) == ("rank", 1, "shards", 0)
    reads = [json.loads(line) for line in (spec.resolved_run_dir() / "ps_reads.jsonl").read_text().splitlines()]
    assert max(r["clock"] - r["min_applied"] for r in reads) <= 1
    clocks = [sorted({r["clock"] for r in reads if r["worker"] == w}) for w in range(4)]
    assert all(c == list(range(len(c))) for c in clocks), clocks
    assert clocks[0] == clocks[2] and clocks[1] == clocks[3]  # a replica's stages read at the same clocks
    assert len(clocks[0]) + len(clocks[1]) == 5 * 2  # the run's budget of replica steps
