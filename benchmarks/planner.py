"""The planner against published runs: what it picks, and how its choice and the published layout compare.

For Megatron's 1T GPT on 3,072 A100 (Narayanan et al. 2021) and Llama 3 405B on 16,384 H100
(``orchestrator.planning.published``), the search prices every dp × tp × pp × cp × ZeRO × micro-batch ×
recompute × schedule split (uneven stage splits allowed) and reports its fastest layout that fits with
10% headroom, the published degrees with the planner's best remaining knobs (ZeRO stage, micro-batch,
recompute, schedule), predicted step time and per-rank peak for both, and the search's own wall time and
distinct rank estimates. Pure arithmetic: no GPU, no Ray.

It also times ``raymesh plan`` of Llama 3 405B (8K tokens, 2,048 sequences a step) on 2,048 nodes x 8 H200,
the README's figure: the whole command in a fresh process, imports and both of the picker's searches
included (the best of ``--repeat`` runs: the machine may be shared).

    python benchmarks/planner.py --out benchmarks/results/planner.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.planning import layout_search as ls
from orchestrator.planning import time_model as tm
from orchestrator.planning.layout_picker import pick_layout
from orchestrator.planning.published import RUNS
from orchestrator.spec import load_spec
from orchestrator.units import human_bytes

ROOT = Path(__file__).resolve().parents[1]
PLAN_JOB = ["examples/mixed_precision_bf16.yaml", "--set", "model.preset=llama3-405b", "--set", "model.seq_len=8192",
            "--set", "train.global_batch_size=2048"]
PLAN_CLUSTER = ["--nodes", "2048", "--gpus-per-node", "8", "--gpu", "H200"]


def row(c: ls.Candidate) -> dict:
    return {"layout": c.layout.label(), "step_s": round(c.step_s, 2), "peak_gb": round(c.peak / 1e9, 1),
            **{k: round(v, 2) for k, v in c.time.as_dict().items()}}


def compare(key: str, headroom: float = 0.1) -> dict:
    run = RUNS[key]
    t0, c0 = time.perf_counter(), time.process_time()
    result = ls.search(run.shape, run.gpus, tm.gpu(run.gpu), headroom=headroom)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    published = [c for c in result.best if all(getattr(c.layout, k) == v for k, v in run.degrees.items())]
    return {"run": run.name, "gpus": run.gpus, "gpu": run.gpu, "published_degrees": run.degrees,
            "choice": row(result.best[0]), "published": row(published[0]) if published else None,
            "published_fits_with_headroom": bool(published), "limit_gb": round(result.limit / 1e9, 1),
            "search_s": round(wall, 2), "search_cpu_s": round(cpu, 2), "candidates": result.considered,
            "rank_estimates": result.rank_estimates,
            "why_others_lost": ls.losers_by_axis(result)}


def plan_at_scale(repeat: int) -> dict:
    """``raymesh plan`` of the README's job: what its search counts and picks, and the whole command's wall and
    CPU seconds in a fresh process, imports included (the best of ``repeat``)."""
    choice = pick_layout(load_spec(ROOT / PLAN_JOB[0], PLAN_JOB[2::2]), 2048, 8, gpu_type="H200")
    runs = [_timed_plan() for _ in range(repeat)]
    return {"job": "Llama 3 405B, seq 8192, global batch 2048", "cluster": "2048 nodes x 8 H200",
            "command": " ".join(["raymesh plan", *PLAN_JOB, *PLAN_CLUSTER]),
            "picked": choice.candidate.layout.label(), "candidates": choice.result.considered,
            "rank_estimates": choice.result.rank_estimates,
            "plan_s": round(min(w for w, _ in runs), 2), "plan_cpu_s": round(min(c for _, c in runs), 2)}


def _timed_plan() -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one ``raymesh plan`` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "orchestrator.cli", "plan", *PLAN_JOB, *PLAN_CLUSTER], cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the comparison here as JSON")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the timed plan; the best is kept")
    args = parser.parse_args()
    out = {key: compare(key) for key in RUNS}
    for r in out.values():
        print(f"{r['run']} on {r['gpus']} {r['gpu']} (search {r['search_s']} s, {r['search_cpu_s']} s CPU, "
              f"{r['candidates']} candidates, "
              f"{r['rank_estimates']} rank estimates); memory limit {human_bytes(r['limit_gb'] * 1e9)}")
        for name in ("choice", "published"):
            c = r[name]
            print(f"  {name:>9}: {c['layout']}: {c['step_s']} s/step, peak {c['peak_gb']} GB" if c else
                  f"  {name:>9}: does not fit with headroom")
    plan = out["plan_llama3_405b_16384_h200"] = plan_at_scale(args.repeat)
    print(f"{plan['command']}: {plan['plan_s']} s wall, {plan['plan_cpu_s']} s CPU (best of {args.repeat}); "
          f"{plan['candidates']} candidates, {plan['rank_estimates']} rank estimates, picked {plan['picked']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
