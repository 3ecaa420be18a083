"""The control plane at scale: the real controller over up to 16,384 virtual ranks on this machine.

For each world size the job runs on the scale simulator (``orchestrator/runtime/simulated.py``): ``--hosts`` Ray
actor processes (64 by default; fewer for small worlds) each step a block of virtual ranks by sleeping ``--step-s``
and report one record per rank; the ranks exchange their step summaries up the same tree real ranks use, rank 0
hands the controller one merged record per step through its desk, and the controller (``TrainingJob``, unchanged)
runs in this process with its observers (``steps.jsonl``, the event log). Midway one virtual rank is killed through
the fault path a user's ``raymesh inject`` takes; it is replaced and the grid rolls back to the in-memory snapshot
(zero simulated restore time). Reported per world size:

- ``step_period_over_step_s``: the median time between two steps' records over the set step time (1.00: the
  control plane adds nothing to a step);
- ``controller_cpu_ms_per_step``: this process's CPU time (the controller and its Ray client threads) per step,
  over the steady steps before the fault;
- ``controller_rss_mb``: this process's resident memory at the end;
- ``kill_to_stepping_s``: from the rank's death to the ranks stepping again (the first record after recovery,
  less one step time), and ``mttr_s``, the recovery record's own figure.

Starts Ray (holds /tmp/raymesh-ray.lock while it runs).

    python benchmarks/control_plane.py --ranks 8 64 512 4096 16384 --step-s 1 --out FILE
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator import JobSpec, TrainingJob
from orchestrator.observability.observers import JobObserver
from orchestrator.runtime.simulated import SimRuntime


class Clock(JobObserver):
    """Each step's record time, and this process's CPU seconds when it was shown; kills a rank at ``kill_at``."""

    def __init__(self, job: TrainingJob, kill_at: int, rank: int):
        self.job, self.kill_at, self.rank = job, kill_at, rank
        self.seen: list[tuple[int, float, float]] = []  # (step, record time, process CPU seconds)

    def on_step(self, report) -> None:
        self.seen.append((report.record["step"], report.record["time"], time.process_time()))
        if report.record["step"] == self.kill_at:
            self.kill_at = -1
            self.job.inject_fault("kill_rank", self.rank, 1.0)


def job_spec(ranks: int, steps: int, data: Path, run_dir: Path) -> JobSpec:
    return JobSpec.from_dict({
        "name": f"sim-{ranks}",
        "model": {"d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64, "seq_len": 32},
        "parallel": {"dp": ranks, "device": "cpu"},
        "train": {"steps": steps, "global_batch_size": ranks, "microbatches": 1},
        "checkpoint": {"every": 0, "memory_every": 1},
        "fault_tolerance": {"warm_spares": False},
        "data": {"path": str(data)}, "run_dir": str(run_dir),
    })


def measure(ranks: int, hosts: int, step_s: float, steps: int, data: Path, work: Path) -> dict:
    """One world size: its steady step period and controller cost, then one killed rank's recovery."""
    kill_at = steps // 2
    spec = job_spec(ranks, steps, data, work / f"run-{ranks}")
    runtime = SimRuntime(hosts, step_s)
    job = TrainingJob(spec, progress=False, runtime=runtime)
    clock = Clock(job, kill_at, rank=ranks - 1)
    job.observers.add(clock)
    result = job.run()
    steady = [s for s in clock.seen if 2 <= s[0] <= kill_at][: kill_at - 1]
    periods = [b[1] - a[1] for a, b in itertools.pairwise(steady) if b[0] == a[0] + 1]
    cpu = (steady[-1][2] - steady[0][2]) / (len(steady) - 1)
    died = runtime.groups[-1].died_at
    after = next(t for _, t, _ in clock.seen if t > died)  # the first step completed after the kill
    (recovery,) = result.recoveries
    return {"ranks": ranks, "hosts": min(hosts, ranks), "steps": len(result.losses), "step_s": step_s,
            "step_period_over_step_s": round(statistics.median(periods) / step_s, 4),
            "controller_cpu_ms_per_step": round(cpu * 1e3, 2),
            "controller_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "kill_to_stepping_s": round(after - step_s - died, 3), "mttr_s": recovery["mttr_s"],
            "lost_steps": recovery["lost_steps"], "status": result.status}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096, 16384])
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=12, help="steps per world size; a rank is killed after half")
    ap.add_argument("--hosts", type=int, default=64,
                    help="host processes the virtual ranks are spread over (each a Ray actor on this machine's cores)")
    ap.add_argument("--out", default="benchmarks/results/control_plane.json")
    args = ap.parse_args()
    import ray

    from workers.data import prepare_data

    with open("/tmp/raymesh-ray.lock", "w") as lock, tempfile.TemporaryDirectory() as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        work = Path(tmp)
        source = work / "src"
        source.mkdir()
        (source / "a.txt").write_text("virtual ranks read no data; the job file names some\n" * 50)
        prepare_data([source], work / "data")
        ray.init(num_cpus=2, log_to_driver=False)
        rows = []
        for ranks in args.ranks:
            rows.append(measure(ranks, args.hosts, args.step_s, args.steps, work / "data", work))
            print(json.dumps(rows[-1]), flush=True)
        ray.shutdown()
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
