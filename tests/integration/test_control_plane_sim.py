"""The real controller over 512 virtual ranks on 8 Ray processes (the scale simulator), a rank killed midway.

What ``benchmarks/control_plane.py`` measures at 16,384 ranks, checked for behaviour here at a size the suite can
afford: the job trains to the end, the killed virtual rank is replaced and the grid rolls back to its in-memory
snapshot losing nothing, the controller's records carry each rank's detail only on sampled steps (512 ranks:
every other step) and the reduction over the ranks on the others, and the run's figures are what the virtual
ranks report.
"""

from __future__ import annotations

import json

from orchestrator import JobSpec, TrainingJob
from orchestrator.observability.observers import JobObserver
from orchestrator.runtime.simulated import SimRuntime

RANKS, HOSTS, STEPS = 512, 8, 8


class KillAt(JobObserver):
    def __init__(self, job: TrainingJob, step: int, rank: int):
        self.job, self.step, self.rank = job, step, rank

    def on_step(self, report) -> None:
        if report.record["step"] == self.step:
            self.step = -1
            self.job.inject_fault("kill_rank", self.rank, 1.0)


def test_a_killed_virtual_rank_of_512_is_replaced_from_memory_and_the_records_stay_small(ray_cluster, token_data,
                                                                                         tmp_path):
    spec = JobSpec.from_dict({
        "name": "sim", "model": {"d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64, "seq_len": 32},
        "parallel": {"dp": RANKS, "device": "cpu"},
        "train": {"steps": STEPS, "global_batch_size": RANKS, "microbatches": 1},
        "checkpoint": {"every": 0, "memory_every": 1}, "fault_tolerance": {"warm_spares": False},
        "data": {"path": str(token_data)}, "run_dir": str(tmp_path / "run")})
    runtime = SimRuntime(HOSTS, step_s=0.05)
    job = TrainingJob(spec, progress=False, runtime=runtime)
    job.observers.add(KillAt(job, 3, RANKS - 1))
    result = job.run()

    assert result.status == "finished" and result.losses == [1.0 / s for s in range(1, STEPS + 1)]
    (rec,) = result.recoveries
    assert (rec["kind"], rec["rank"], rec["source"], rec["lost_steps"]) == ("rank", RANKS - 1, "memory", 0)
    assert len(runtime.groups) == 1 and runtime.groups[0].died_at is not None

    lines = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    detailed = [r for r in lines if "phases" in r]
    assert detailed and all(len(r["phases"]) == RANKS for r in detailed)  # each rank's own, on sampled steps
    reduced = [r for r in lines if "phases" not in r]
    assert reduced and all(r["ranks"]["count"] == RANKS and len(json.dumps(r)) < 2000 for r in reduced)
