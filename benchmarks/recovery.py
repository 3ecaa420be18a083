"""Recovery at 8 ranks: raymesh's restart-only-the-failed-rank against a full restart from disk.

Four runs of the same tiny GPT (dp=4 × pp=2, CPU), one after the other in
this script so their ratios are comparable on a noisy machine:

- ``no_faults``: the same job, no failures (goodput ceiling: snapshots, saves);
- ``memory``: kill_rank of a random rank every ``--every-s`` seconds (soak
  schedule, seeded), only the dead rank replaced, state from the in-memory
  snapshot of every step (``recovery: replace_failed``, ``memory_every: 1``);
- ``disk``: the same failures with snapshots off, so the replaced rank and the
  survivors load the last disk checkpoint (the fallback when a rank's replica
  died with it);
- ``restart_all``: the same failures answered as Ray Train and torchrun do:
  every rank torn down and restarted from the last disk checkpoint;
- ``defaults``: the same failures with the ``checkpoint`` and
  ``fault_tolerance`` sections left out (the job file's defaults: snapshots
  every step for these zero-0 mirrors, async checkpoints every 50 steps,
  failed ranks leaving their gloo groups so no survivor stays blocked,
  a warm spare per node, a 60 s collective timeout, ``max_restarts: 20``
  within ``restart_window_s: 600``);
- ``keep_training``: the same failures on the job file's defaults but ``recovery: keep_training`` (plain data
  parallelism only: run it with ``--dp 8 --pp 1``): the other replicas train on while the failed one is rebuilt.
  Its ``replica_goodput`` weighs each step by the replicas that ran it (a step three of four replicas ran
  trained three quarters of the batch), so skipped data is not counted as productive.

The tuned runs (``memory``, ``disk``, ``restart_all``) set
``collective_timeout_s: 5`` and ``max_restarts: 1000`` by hand.

Every run checkpoints to disk every ``--ckpt-every`` steps and stops after
``--duration-s`` seconds of training. Reported per run: MTTR (fault to the next
completed step), lost steps, goodput (productive step time ÷ training wall
time), steps done and, per recovering run, the seconds lost per failure from
its own records and the goodput they imply at one failure every ``--every-s``
(``time_lost`` says what counts). Holds /tmp/raymesh-ray.lock while it runs
(it starts Ray; do not wrap it in ``flock`` of the same file: it would wait for
itself).

    python benchmarks/recovery.py --data data/stdlib --duration-s 150
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root
from benchmarks.provenance import write_result

LOCK = "/tmp/raymesh-ray.lock"


def job_dict(args, run_dir: Path, name: str) -> dict:
    return {
        "name": f"recovery-{name}",
        "run_dir": str(run_dir / name),
        "model": {"d_model": 64, "n_layers": 4, "n_heads": 4, "seq_len": 64},
        "data": {"path": str(Path(args.data).resolve())},
        "parallel": {"dp": args.dp, "pp": args.pp, "device": "cpu"},
        "optim": {"lr": 3e-3},
        "train": {"steps": 1_000_000, "global_batch_size": 16, "microbatches": 2},
        "checkpoint": {"every": args.ckpt_every, "keep": 2, "memory_every": 1, "async_save": args.async_save},
        "fault_tolerance": {"heartbeat_timeout_s": 60, "collective_timeout_s": 5, "max_restarts": 1000},
    }


ON_DEFAULTS = {"checkpoint": None, "fault_tolerance": None}
SCENARIOS = {  # name -> (overrides of job_dict, with the soak fault?); a section set to None: the job file's defaults
    "no_faults": ({}, False),
    "memory": ({}, True),
    "disk": ({"checkpoint": {"memory_every": 0}}, True),
    "restart_all": ({"checkpoint": {"memory_every": 0}, "fault_tolerance": {"recovery": "restart_all"}}, True),
    "defaults": (ON_DEFAULTS, True),
    "keep_training": ({**ON_DEFAULTS, "+fault_tolerance": {"recovery": "keep_training"}}, True),
}


def run(args, run_dir: Path, name: str) -> dict:
    from orchestrator import JobSpec, TrainingJob

    raw = job_dict(args, run_dir, name)
    overrides, faulty = SCENARIOS[name]
    for section, fields in overrides.items():
        if fields is None:
            del raw[section]  # nothing tuned: what a job file without the section gets
        else:  # "+section": set on the defaults, after the section was left out
            raw.setdefault(section.lstrip("+"), {}).update(fields)
    if faulty:
        raw["faults"] = [{"kind": "kill_rank", "rank": "random", "every_s": args.every_s, "jitter_s": args.jitter_s,
                          "seed": args.seed}]
    job = TrainingJob(JobSpec.from_dict(raw), progress=False)
    duration = args.duration_s if faulty else args.duration_s / 2
    threading.Thread(target=_stop_after, args=(job, duration), daemon=True).start()
    try:
        result = job.run()
    except RuntimeError as exc:  # the restart budget spent (max_restarts): that is this run's result
        return {"failed": str(exc), "recoveries": len(job.recoveries)}
    recs = result.recoveries
    lines = [json.loads(line) for line in (job.run_dir / "steps.jsonl").read_text().splitlines()]
    return {**_degraded(job, result, lines), **time_lost(job, result, lines, args.every_s),
        "failures_injected": sum(soak.firings for soak in job.faults.repeating),
        "steps": result.steps,
        "goodput": result.goodput,
        "startup_s": result.startup_s,
        "median_step_s": statistics.median(result.step_time_s),
        "recoveries": [{k: r[k] for k in ("rank", "at_step", "source", "lost_steps", "mttr_s", "phases_s")}
                       for r in recs],
        "mttr_s_mean": statistics.fmean(r["mttr_s"] for r in recs) if recs else None,
        "mttr_phases_s_mean": {phase: statistics.fmean(r["phases_s"].get(phase, 0.0) for r in recs)
                               for phase in dict.fromkeys(p for r in recs for p in r["phases_s"])},
        "mttr_s_max": max((r["mttr_s"] for r in recs), default=None),
        "lost_steps_max": max((r["lost_steps"] for r in recs), default=None),
    }


def _degraded(job, result, lines: list[dict]) -> dict:
    """``recovery: keep_training``'s steps run without the failed replicas, and the goodput weighed by the replicas
    that ran each step (``replicas`` on its ``steps.jsonl`` line; the others ran all of them)."""
    dp = job.spec.parallel.dp
    ran = {line["step"]: line.get("replicas", dp) for line in lines}
    first = result.steps - len(result.step_time_s) + 1
    weighed = sum(t * ran.get(first + i, dp) / dp for i, t in enumerate(result.step_time_s))
    degraded = [s for r in result.recoveries for s in r.get("degraded_steps", [])]
    if not degraded:
        return {}
    return {"degraded_steps": len(degraded), "skipped_sequences": sum(r.get("skipped_sequences", 0)
                                                                      for r in result.recoveries),
            "replica_goodput": result.goodput * weighed / max(sum(result.step_time_s), 1e-9)}


def time_lost(job, result, lines: list[dict], every_s: float) -> dict:
    """The seconds each failure cost, from the run's own records, and the goodput that implies at one failure every
    ``every_s`` (``1 - lost / every_s``), beside the wall-clock goodput, which also counts what costs time without
    failures (start-up, snapshots, saves) and on a shared machine its load.

    Lost per failure (the mean over the run's recoveries) is the sum of: ``recovery``: each recovery's MTTR (fault
    to the next completed step) less one median step (the time that step would have taken anyway), plus its lost
    steps at a median step each; ``rejoin``: under ``keep_training``, the pause at each rejoin in which no rank
    stepped (``steps.jsonl`` times: the completion of the rejoin step to the next completion, less one median step;
    ``rejoin_s`` when the run ended there); ``skipped``: the data the failed replicas' shares skipped, as
    replica-step time (each degraded step's time times the share of replicas that did not run it)."""
    recs = result.recoveries
    if not recs:
        return {}
    median, dp = statistics.median(result.step_time_s), job.spec.parallel.dp
    parts = {
        "recovery": sum(max(0.0, r["mttr_s"] - median) + r["lost_steps"] * median for r in recs),
        "rejoin": sum(_pause_after(lines, r["rejoined_at_step"], r.get("rejoin_s", 0.0), median)
                      for r in recs if r.get("rejoined_at_step") is not None),
        "skipped": sum(line["step_s"] * (dp - line["replicas"]) / dp for line in lines if "replicas" in line),
    }
    lost = sum(parts.values()) / len(recs)
    return {"lost_s_per_failure": lost, "lost_s_per_failure_parts": {k: v / len(recs) for k, v in parts.items()},
            "goodput_at_failure_every_s": 1.0 - lost / every_s}


def _pause_after(lines: list[dict], step: int, recorded_s: float, median_s: float) -> float:
    """The seconds lost at the rejoin after ``step`` completed (its last record, the one the rejoin followed): to the
    next step's completion, less one median step (the time that step would have taken anyway, so a slow first step
    of the rejoined group counts as lost, as in ``recovery``); ``recorded_s`` when no step followed."""
    at = max((i for i, line in enumerate(lines) if line["step"] == step), default=None)
    if at is None or at + 1 >= len(lines):
        return recorded_s
    return max(0.0, lines[at + 1]["time"] - lines[at]["time"] - median_s)


def _stop_after(job, seconds: float) -> None:
    """Stop ``seconds`` after training starts (start-up is not part of the soak)."""
    while job.state not in ("running", "failed"):
        time.sleep(0.2)
    time.sleep(seconds)
    job.request_stop("benchmark duration reached")


def _ratios(runs: dict) -> dict:
    """MTTR and goodput of each recovering run against restart-all (the runs there are)."""
    full = runs.get("restart_all")
    if full is None or not full["mttr_s_mean"]:
        return {}
    out = {}
    for name in ("memory", "disk", "defaults", "keep_training"):
        if runs.get(name, {}).get("mttr_s_mean"):
            out[f"mttr_restart_all_over_{name}"] = full["mttr_s_mean"] / runs[name]["mttr_s_mean"]
            out[f"goodput_{name}_over_restart_all"] = runs[name]["goodput"] / full["goodput"]
    return out


def _num(value, spec: str) -> str:
    return format(value, spec) if value is not None else format("-", spec[0] + spec[1:].split(".")[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--duration-s", type=float, default=150.0, help="training seconds per run with failures")
    ap.add_argument("--every-s", type=float, default=60.0, help="a failure every this many seconds")
    ap.add_argument("--jitter-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=10, help="disk checkpoint cadence in steps")
    ap.add_argument("--async-save", action="store_true", help="disk checkpoints saved in the background (all runs)")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2, help="1 for keep_training (plain data parallelism only)")
    ap.add_argument("--out", default="benchmarks/results/recovery.json")
    ap.add_argument("--runs", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS),
                    help="a subset of the runs, for a quick look (ratios need restart_all)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with open(LOCK, "w") as lock, tempfile.TemporaryDirectory(prefix="raymesh-recovery-") as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        runs = {name: run(args, Path(tmp), name) for name in args.runs}
    report = {
        "layout": f"dp={args.dp} x pp={args.pp} ({args.dp * args.pp} ranks), CPU", "cpus": os.cpu_count(),
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "note": "2-core machine shared with other sessions' test runs: absolute times are noisy, ratios less so",
        "args": vars(args), "runs": runs, "ratios": _ratios(runs),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, report, args.data)
    print(f"{'run':12}{'failures':>9}{'MTTR mean s':>13}{'MTTR max s':>12}{'lost max':>10}{'goodput':>9}{'steps':>7}")
    for name, r in [(name, r) for name, r in runs.items() if "failed" in r]:
        print(f"{name:12} failed after {r['recoveries']} recoveries: {r['failed']}")
    runs = {name: r for name, r in runs.items() if "failed" not in r}
    for name, r in runs.items():
        print(f"{name:12}{len(r['recoveries']):>9}{_num(r['mttr_s_mean'], '>13.1f')}{_num(r['mttr_s_max'], '>12.1f')}"
              f"{_num(r['lost_steps_max'], '>10')}{r['goodput']:>9.1%}{r['steps']:>7}")
    for name, r in runs.items():
        if r["mttr_phases_s_mean"]:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in r["mttr_phases_s_mean"].items())
            print(f"{name} MTTR by phase (mean s): {phases}")
    for name, r in runs.items():
        if "replica_goodput" in r:
            print(f"{name}: {r['degraded_steps']} steps ran without a failed replica, {r['skipped_sequences']} "
                  f"sequences skipped; goodput weighed by the replicas that ran each step {r['replica_goodput']:.1%}")
    for name, r in runs.items():
        if "lost_s_per_failure" in r:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r["lost_s_per_failure_parts"].items())
            print(f"{name}: {r['lost_s_per_failure']:.2f} s lost per failure ({parts}); goodput at one failure "
                  f"every {args.every_s:.0f} s: {r['goodput_at_failure_every_s']:.1%} (wall clock: {r['goodput']:.1%})")
    for key, value in report["ratios"].items():
        print(f"{key}: {value:.2f}")


if __name__ == "__main__":
    main()
