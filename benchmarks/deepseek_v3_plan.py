"""The planner on DeepSeek-V3 671B at its published layout: 2,048 H800 (80 GB), pipeline 16, experts over 64
ranks, data parallel 128 (ZeRO-1), no tensor parallelism, 4K sequences, 15,360 a step (DeepSeek-AI 2024, "DeepSeek-V3
Technical Report", sections 3.1-3.2 and 4.2).

What it reports: the parameters the planner counts (total and active per token: the published 671B and 37B; with
the one multi-token prediction module the hub's 685B, whose 14B MTP module stores its own copy of the embedding and
head, shared here and counted once), and
the per-rank memory estimate of that layout in bf16 with full recompute, against the H800's 80 GB. The published
run trains in FP8 with DualPipe and recomputes only RMSNorm and MLA's up-projections: raymesh's estimate is of
its own bf16 run at that layout, not of theirs. Run: ``python benchmarks/deepseek_v3_plan.py --out
benchmarks/results/deepseek_v3_plan.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from orchestrator import JobSpec
from orchestrator.planning.estimate import mtp_params, peak_rank, stage_expert_params, stage_params
from orchestrator.planning.time_model import GPUS

GPU = "H800"
PUBLISHED = {"gpus": 2048, "dp": 128, "ep": 64, "pp": 16, "tp": 1, "params": 671e9, "active": 37e9,
             "with_mtp": 685e9, "mtp": 14e9}
SPLIT = [3] + [4] * 14 + [2]  # 61 layers over 16 stages, the first and last lighter (embedding, head)


def spec(microbatches: int = 120) -> JobSpec:
    """The published layout as a raymesh job (model.preset deepseek-v3-671b)."""
    return JobSpec.from_dict({
        "data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "model": {"preset": "deepseek-v3-671b"},
        "parallel": {"dp": PUBLISHED["dp"], "ep": PUBLISHED["ep"], "pp": PUBLISHED["pp"], "zero": 1,
                     "pp_split": SPLIT, "device": "cuda"},
        "precision": {"dtype": "bf16"}, "memory": {"recompute": "full"}, "plan": {"gpu": GPU},
        "train": {"global_batch_size": 15360, "microbatches": microbatches}})


def mtp_figures(main: int) -> dict:
    """The one MTP module DeepSeek-V3 trains (``model.mtp_layers: 1``), counted on a one-stage copy of the layout
    (raymesh refuses MTP under pp): its own parameters, and as the hub stores it, with a copy of the embedding and
    the head beside them."""
    job = JobSpec.from_dict({
        "data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "model": {"preset": "deepseek-v3-671b", "mtp_layers": 1},
        "parallel": {"dp": PUBLISHED["dp"], "ep": PUBLISHED["ep"], "device": "cuda"},
        "train": {"global_batch_size": 15360}})
    module, copies = sum(mtp_params(job)), 2 * job.model.vocab_size * job.model.d_model
    return {"mtp_params": module, "mtp_stored": module + copies, "mtp_published": PUBLISHED["mtp"],
            "with_mtp_params": main + module, "with_mtp_stored": main + module + copies,
            "with_mtp_published": PUBLISHED["with_mtp"]}


def figures() -> dict:
    """Parameters counted and the peak rank's memory estimate."""
    job = spec()
    experts = stage_expert_params(job, 0, 1)
    total = sum(stage_params(job, 0, 1)) + experts
    moe = job.model.moe
    active = total - experts + experts * moe.k // moe.experts
    peak = peak_rank(job)
    return {"layout": {k: PUBLISHED[k] for k in ("gpus", "dp", "ep", "pp", "tp")}, "gpu": GPU,
            "params": total, "params_published": PUBLISHED["params"], "active_params": active,
            "active_published": PUBLISHED["active"], **mtp_figures(total), "peak_rank": peak.rank,
            "peak_stage": peak.coords.get("pp"),
            "peak_gb": round(peak.total_bytes / 1e9, 1), "gpu_gb": GPUS[GPU].memory / 1e9,
            "fits": peak.total_bytes <= GPUS[GPU].memory,
            "peak_parts_gb": {k: round(v / 1e9, 1) for k, v in peak.as_dict().items()
                              if isinstance(v, int) and k not in ("rank", "params")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = figures()
    print(json.dumps(out, indent=2))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
