"""The planner on DeepSeek-V3 671B at its published layout: 2,048 H800 (80 GB), pipeline 16, experts over 64
ranks, data parallel 128 (ZeRO-1), no tensor parallelism, 4K sequences, 15,360 a step (DeepSeek-AI 2024, "DeepSeek-V3
Technical Report", sections 3.1-3.2 and 4.2).

What it reports: the parameters the planner counts (total and active per token: the published 671B and 37B; with
the one multi-token prediction module the hub's 685B, whose 14B MTP module stores its own copy of the embedding and
head, shared here and counted once), the per-rank memory estimate and predicted step time of that layout in bf16
with full recompute, against the H800's 80 GB, and beside it the planner's own choice (``raymesh plan --nodes 256
--gpus-per-node 8 --gpu H800``: the layout search over dp, tp, pp, ZeRO, micro-batch, recompute, schedule, stage
split and expert parallelism), with the CPU seconds the choice took. The published run trains in FP8 with DualPipe
(its all-to-alls hidden under compute) and recomputes only RMSNorm and MLA's up-projections: raymesh's figures are
of its own bf16 run, not of theirs. For scale, the report's 180K H800 GPU hours per trillion tokens are 19.9 s per
step of 15,360 x 4,096 tokens on 2,048 GPUs. Run: ``python benchmarks/deepseek_v3_plan.py --out
benchmarks/results/deepseek_v3_plan.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from orchestrator import JobSpec
from orchestrator.planning import layout_search as ls
from orchestrator.planning.estimate import mtp_params, peak_rank, stage_expert_params, stage_params
from orchestrator.planning.layout_picker import pick_layout, plan_gpu
from orchestrator.planning.time_model import GPUS

GPU = "H800"
PUBLISHED = {"gpus": 2048, "dp": 128, "ep": 64, "pp": 16, "tp": 1, "params": 671e9, "active": 37e9,
             "with_mtp": 685e9, "mtp": 14e9}
GPU_HOURS_PER_TRILLION = 180e3  # the report's section 1: 180K H800 GPU hours per trillion training tokens
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


def published_step_s() -> float:
    """Seconds per step the report's GPU hours give: 15,360 sequences of 4,096 tokens on 2,048 GPUs."""
    tokens = 15360 * 4096
    return GPU_HOURS_PER_TRILLION * 3600 / PUBLISHED["gpus"] * tokens / 1e12


def predicted(job: JobSpec) -> dict:
    """The time model's step and its terms for a job's layout on its own ``pp_split`` (``layout_search.Evaluator``;
    ``layout_of`` alone prices the even split)."""
    g, layout = plan_gpu(job, 8, None, GPU), replace(ls.layout_of(job), split=tuple(job.stage_split))
    step, _ = ls.Evaluator(ls.Shape.of(job), g, job.plan.efficiency).step_time(layout)
    return {k: round(v, 2) for k, v in step.as_dict().items()}


def planner_choice(job: JobSpec) -> dict:
    """What ``raymesh plan --nodes 256 --gpus-per-node 8 --gpu H800`` picks for the same model and batch."""
    start = time.process_time()
    choice = pick_layout(job, PUBLISHED["gpus"] // 8, 8, gpu_type=GPU)
    seconds = time.process_time() - start
    p, peak = choice.spec.parallel, choice.peak
    return {"layout": choice.candidate.layout.label(), "dp": p.dp, "ep": p.ep, "pp": p.pp, "tp": p.tp, "cp": p.cp,
            "zero": p.zero, "recompute": choice.spec.memory.recompute, "schedule": p.pp_schedule,
            "pp_split": list(choice.spec.stage_split), "time": predicted(choice.spec),
            "peak_gb": round(peak.total_bytes / 1e9, 1), "peak_stage": peak.coords.get("pp"),
            "layouts_priced": choice.result.considered, "search_cpu_s": round(seconds, 1)}


def figures() -> dict:
    """Parameters counted, the published layout's memory estimate and predicted step, and the planner's choice."""
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
                              if isinstance(v, int) and k not in ("rank", "params")},
            "time": predicted(job), "published_step_s": round(published_step_s(), 1),
            "planner": planner_choice(job)}


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
