"""The planner against published runs: what it picks, and how its choice and the published layout compare.

For Megatron's 1T GPT on 3,072 A100 (Narayanan et al. 2021) and Llama 3 405B on 16,384 H100
(``orchestrator.planning.published``), the search prices every dp × tp × pp × cp × ZeRO × micro-batch ×
recompute × schedule split (uneven stage splits allowed) and reports its fastest layout that fits with
10% headroom, the published degrees with the planner's best remaining knobs (ZeRO stage, micro-batch,
recompute, schedule), predicted step time and per-rank peak for both, and the search's own wall time and
distinct rank estimates. Pure arithmetic: no GPU, no Ray.

    python benchmarks/planner.py --out benchmarks/results/planner.json
"""

from __future__ import annotations

import argparse
import json
import time

from orchestrator.planning import layout_search as ls
from orchestrator.planning import time_model as tm
from orchestrator.planning.memory_model import human_bytes
from orchestrator.planning.published import RUNS


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the comparison here as JSON")
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
