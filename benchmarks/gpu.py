"""Every figure issue 19 asks of one GPU, from one command: tokens/s and MFU, memory against the planner,
torchtitan on the same job, a profiler trace, and the NCCL abort check.

    python benchmarks/gpu.py --steps 10 --trace runs/gpu-trace --check-abort --out runs/gpu.json
    python benchmarks/gpu.py --set train.global_batch_size=16 --variant 'train.compile=true'  # any job field
    python benchmarks/gpu.py --device cpu --set model.d_model=64 ...                          # the logic, on a CPU
    python benchmarks/gpu.py --steps 10 --suite issue48 --out runs/gpu48.json   # low precision, picked defaults

The JSON goes to stdout (and ``--out``), the Markdown table to stderr (and ``--markdown``).

Why no Ray: the GPU machine may have none, and nothing measured here needs it. The job runs at world size 1
through the worker-level code the Ray actor runs (``workers.trainer.Trainer`` fed ``JobSpec.worker_dict()``,
as ``tests/support/parity_harness.py`` does), so its ``StepResult``s are the records a Ray run would hand the
controller. Default job: ``model.preset: llama-1b`` at seq 2048, bf16 (ZeRO-2 on one rank, so FSDP2's
mixed-precision policy on a GPU), full recompute, batch 8, AdamW, on
synthetic tokens; ``--set key.path=value`` changes any job field (as ``raymesh run --set`` does), so fields
added later (``precision.policy``, ``train.compile``, ``optim.implementation``) pass through unchanged.

Figures, all over the timed steps only (``--warmup`` steps first are left out):

- ``throughput``: tokens/s = tokens / step seconds summed from the ``StepResult``s (``time_s.step``, what the
  controller's step record divides by, less the Ray round trip), and a wall-clock cross-check with the device
  synchronised at both ends; MFU = model FLOPs per token (``orchestrator.planning.flops``, recompute not
  counted) × tokens/s ÷ peak FLOP/s of the device by name (H100/H200: 989 TFLOP/s bf16 dense), the
  controller's formula (``orchestrator.observability.step_accounting``); HFU counts the recomputed forward too.
- ``memory``: the largest ``StepResult.peak_memory_bytes`` against the planner's in-step peak for the same
  job (``estimate_rank(spec, 0).total_bytes``: the ``total`` column of ``raymesh plan``), relative error
  (predicted - measured) / measured as the summary's ``memory`` section reports it. On a GPU the peak is
  ``torch.cuda.max_memory_allocated`` with the peak reset before each step; on a CPU it is the process's
  ``VmHWM`` (what the trainer reports there), which holds Python and torch themselves: not comparable.
- ``torchtitan``: the same shape, seq, batch, precision and recompute through torchtitan's own entry point
  (``benchmarks/gpu_torchtitan.py``); null with the reason when torchtitan is not importable.
- ``profile`` (``--trace DIR``): two more steps under ``torch.profiler``: a chrome trace and the top-10 ops.
- ``abort`` (``--check-abort``): a killed peer in a two-process group on one device (``benchmarks/gpu_abort.py``).
- ``variants`` (``--variant 'KEY=VALUE ...'``, repeatable): the job trained again with those fields changed over
  ``--set``, each with its own throughput and memory figures (compile on/off, a precision policy, an optimizer
  implementation: one lease, one table). A field set to ``null`` is left for raymesh to pick, as the controller
  picks it (``orchestrator.planning.fast_defaults``; the picks and why under ``defaults_picked``). A variant with
  ``precision.float8`` also runs torchtitan with its float8 converter on the same job (``torchtitan`` in the
  variant, with the ratios).
- ``ratios`` (``--suite issue48``): issue 48's settings as variants (the default-picked job, float8 rowwise and
  tensorwise, bf16 optimizer state, the offloaded optimizer) and each one's tokens/s and peak over the bf16
  compiled job's from the same run, the planner's error and the ratio to torchtitan's float8.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from orchestrator.errors import SpecError  # noqa: E402
from orchestrator.planning.estimate import estimate_rank, stage_params  # noqa: E402
from orchestrator.planning.fast_defaults import pin_defaults  # noqa: E402
from orchestrator.planning.flops import model_flops_per_token, peak_flops_per_rank, utilization  # noqa: E402
from orchestrator.spec import JobSpec  # noqa: E402
from orchestrator.spec.raw import apply_overrides  # noqa: E402
from workers.data import write_token_rows  # noqa: E402
from workers.parallel.process_group import listen_on  # noqa: E402
from workers.protocol import StepResult  # noqa: E402

BASE_JOB = {
    "name": "gpu-benchmark",
    "model": {"preset": "llama-1b", "seq_len": 2048},
    # ZeRO-2 on a one-rank mesh: FSDP2 units with nothing to shard, so bf16 runs through FSDP2's mixed-precision
    # policy (precision.policy auto on a GPU), as it does on every multi-GPU ZeRO-2/3 job
    "parallel": {"zero": 2},
    "precision": {"dtype": "bf16"},
    "memory": {"recompute": "full"},
    "train": {"global_batch_size": 8, "microbatches": 1},
    "optim": {"name": "adamw", "lr": 3e-4},
    "checkpoint": {"every": 0},
}


# issue 48's settings, each a --variant over the job (--suite issue48), with the baseline each is read against:
# the bf16 compiled job without recompute (the fastest bf16 of the H200 profile) for float8, bf16 moments and the
# offloaded optimizer; and the job with recompute and compile left for the planner to pick
BASELINE_48 = "train.compile=true memory.recompute=none"
SUITE_48 = {
    "default_picked": "memory.recompute=null train.compile=null",
    "bf16_compiled": BASELINE_48,
    "float8_rowwise": f"{BASELINE_48} precision.float8=rowwise",
    "float8_tensorwise": f"{BASELINE_48} precision.float8=tensorwise",
    "bf16_state": f"{BASELINE_48} optim.state_dtype=bf16",
    "offloaded_optimizer": f"{BASELINE_48} memory.offload.optimizer=true",
}
SUITES = {"issue48": SUITE_48}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="steps run first and left out of every figure")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="a job-file field over the default job, as `raymesh run --set` takes it (repeatable)")
    p.add_argument("--variant", dest="variants", action="append", default=[], metavar="'KEY=VALUE ...'",
                   help="also train the job with these fields changed (space-separated, over --set; repeatable): "
                        "one row each of tokens/s, MFU and memory, e.g. --variant 'train.compile=true'")
    p.add_argument("--suite", choices=sorted(SUITES), action="append", default=[],
                   help="add a named set of variants (issue48: the default-picked job, float8 rowwise/tensorwise, "
                        "bf16 optimizer state and the offloaded optimizer against the bf16 compiled job), and the "
                        "ratios between them")
    p.add_argument("--data", help="a prepared token directory (default: synthetic tokens in a temporary one)")
    p.add_argument("--trace", help="profile two more steps: chrome trace and top-10 ops table into this folder")
    p.add_argument("--check-abort", action="store_true", help="run the abort check of a killed peer")
    p.add_argument("--abort-timeout-s", type=float, default=20.0, help="the abort check's group timeout")
    p.add_argument("--torchtitan", choices=("auto", "off"), default="auto",
                   help="auto: run torchtitan on the same job when it is importable")
    p.add_argument("--torchtitan-timeout-s", type=float, default=420.0,
                   help="torchtitan's run is stopped after this long (a device lease runs one command <= 10 min)")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--markdown", help="also write the Markdown table here")
    args = p.parse_args(argv)
    args.variants += [v for suite in args.suite for v in SUITES[suite].values() if v not in args.variants]
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0 (got --steps {args.steps} --warmup {args.warmup})")
    return args


def build_spec(overrides: list[str], device: str, data: str, steps: int) -> JobSpec:
    """The default job with ``overrides`` applied; the device, data and step count are the benchmark's own
    (``train.steps`` shapes the LR schedule, so it is the number of steps this run takes)."""
    raw = apply_overrides(BASE_JOB, overrides)
    raw["parallel"] = {**raw.get("parallel", {}), "device": device}
    raw["data"] = {**raw.get("data", {}), "path": data}
    raw["train"] = {**raw.get("train", {}), "steps": steps}
    return JobSpec.from_dict(raw)


def synthetic_data(spec_without_data: JobSpec, out: Path, steps: int) -> str:
    """Uniform random token ids (seeded), enough for ``steps`` steps without repeating a sample: what a step
    costs does not depend on the ids, and the GPU machine has no corpus."""
    m, batch = spec_without_data.model, spec_without_data.train.global_batch_size
    ids = np.random.default_rng(0).integers(0, m.vocab_size, size=(steps + 1) * batch * (m.seq_len + 1))
    write_token_rows([ids], out, m.vocab_size, "synthetic: uniform random ids, seed 0")
    return str(out)


def device_name(device: torch.device) -> str:
    """As ``RankWorker.setup`` names it for the controller's peak FLOP/s lookup."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_steps(trainer, n: int) -> list[StepResult]:
    """``n`` steps; on a GPU the allocator's peak is reset before each, so a result's peak is its own step's."""
    out = []
    for _ in range(n):
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.device)
        out.append(trainer.train_step())
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(spec: JobSpec, warmup: int, steps: int, trace: str | None) -> dict:
    """Build the rank-0 ``Trainer`` of a one-rank job, run warm-up and timed steps (and the profiled ones)."""
    import torch.distributed as dist

    from workers.trainer import Trainer

    listener = listen_on("127.0.0.1")
    trainer = Trainer(spec.worker_dict(), 0, 1, "127.0.0.1", listener.getsockname()[1], listener=listener)
    try:
        run_steps(trainer, warmup)
        synchronize(trainer.device)
        start = time.perf_counter()
        timed = run_steps(trainer, steps)
        synchronize(trainer.device)
        wall = time.perf_counter() - start
        profile = profile_steps(trainer, trace) if trace else None
        return {"results": timed, "wall_s": wall, "device": trainer.device, "profile": profile}
    finally:
        dist.destroy_process_group()
        release(trainer)


def release(trainer) -> None:
    """Give the device memory back before torchtitan and the abort check's processes need it: the trainer's
    tensors are only freed once their reference cycles are collected, and the caching allocator keeps what
    it reserved until emptied."""
    import gc

    device = trainer.device
    trainer.__dict__.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_steps(trainer, folder: str, steps: int = 2, top: int = 10) -> dict:
    """``steps`` steps under ``torch.profiler``: the chrome trace in ``folder`` (gzipped: Perfetto and
    chrome://tracing open it as it is) and the ``top`` ops by self time on the device (CPU time on a CPU), as a
    table and as rows."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run_steps(trainer, steps)
        synchronize(trainer.device)
    Path(folder).mkdir(parents=True, exist_ok=True)
    raw, trace = Path(folder) / "trace.json", Path(folder) / "trace.json.gz"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(trace, "wb") as dst:  # a 1B model's trace is tens of MB uncompressed
        shutil.copyfileobj(src, dst)
    raw.unlink()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    table = prof.key_averages().table(sort_by=key, row_limit=top)
    (Path(folder) / "top_ops.txt").write_text(table)
    rows = [{"op": e.key, "calls": e.count, "self_us": round(getattr(e, key), 1)} for e in events]
    return {"trace": str(trace), "steps": steps, "sorted_by": key, "top_ops": rows, "table": table}


def throughput(spec: JobSpec, results: list[StepResult], wall_s: float, name: str) -> dict:
    """tokens/s and MFU from the step results, by the controller's own FLOPs and peak (world size 1)."""
    tokens = sum(r.tokens for r in results)
    step_s = sum(r.time_s.step for r in results)
    per_token = model_flops_per_token(spec)
    hardware = model_flops_per_token(spec, spec.memory.recompute)
    peak = peak_flops_per_rank(spec, name)
    tps = tokens / step_s
    return {"tokens": tokens, "step_s": step_s, "tokens_per_s": tps, "wall_s": wall_s,
            "wall_tokens_per_s": tokens / wall_s, "model_flops_per_token": per_token,
            "hardware_flops_per_token": hardware, "peak_flops": peak, "mfu": utilization(per_token, tps, peak),
            "hfu": utilization(hardware, tps, peak),
            "per_step": [{"step": r.step, "step_s": r.time_s.step, "tokens_per_s": r.tokens / r.time_s.step,
                          "mfu": utilization(per_token, r.tokens / r.time_s.step, peak)} for r in results]}


def memory(spec: JobSpec, results: list[StepResult], device: torch.device) -> dict:
    """Measured in-step peak against the planner's, as the run summary's ``memory`` section compares them."""
    measured = max(r.peak_memory_bytes for r in results)
    predicted = estimate_rank(spec, 0)
    source = ("torch.cuda.max_memory_allocated, peak reset before each step" if device.type == "cuda" else
              "VmHWM of the process (Python and torch included): not comparable with the prediction")
    return {"measured_peak_bytes": measured, "predicted_peak_bytes": predicted.total_bytes,
            "relative_error": (predicted.total_bytes - measured) / measured, "source": source,
            "predicted": predicted.as_dict(), "per_step_peak_bytes": [r.peak_memory_bytes for r in results]}


def job_summary(spec: JobSpec) -> dict:
    """What was trained, as the figures need it to be read (and torchtitan to train the same)."""
    m = spec.model
    return {"arch": m.arch, "preset": m.preset, "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
            "n_kv_heads": m.kv_heads, "d_ff": m.ffn_dim, "vocab_size": m.vocab_size, "seq_len": m.seq_len,
            "tie_embeddings": m.tie_embeddings, "global_batch_size": spec.train.global_batch_size,
            "microbatches": spec.train.microbatches, "precision": spec.precision.dtype,
            "recompute": spec.memory.recompute, "compile": spec.train.compile, "float8": spec.precision.float8,
            "state_dtype": spec.optim.state_dtype, "parameters": sum(stage_params(spec, stage=0, n_stages=1))}


def measure(args: argparse.Namespace, overrides: list[str], folder: Path, trace: str | None) -> dict:
    """Train one job (the default with ``overrides``) and take its figures: job, throughput, memory, profile."""
    total = args.warmup + args.steps + (2 if trace else 0)
    folder.mkdir(parents=True, exist_ok=True)
    data = args.data or synthetic_data(build_spec(overrides, args.device, str(folder), total), folder, total)
    # fields left null are picked as the controller picks them (the planner's fast settings on a GPU)
    spec, picked = pin_defaults(build_spec(overrides, args.device, data, total))
    out = train(spec, args.warmup, args.steps, trace)
    name = device_name(out["device"])
    return {"device": name, "overrides": overrides, "job": job_summary(spec),
            "defaults_picked": {field: {"value": value, "why": why} for field, (value, why) in picked.items()},
            "throughput": throughput(spec, out["results"], out["wall_s"], name),
            "memory": memory(spec, out["results"], out["device"]), "profile": out["profile"]}


def run(args: argparse.Namespace) -> dict:
    """The job's figures, torchtitan's on the same job, the abort check, then each ``--variant``'s. Each part
    that fails is recorded (``{"error": ...}``) and the rest still run, and the JSON so far is rewritten to
    ``--out`` after each part: a device lease is minutes long, and one failure should not cost the others."""
    from benchmarks.gpu_abort import check_abort
    from benchmarks.gpu_torchtitan import run_torchtitan, skipped, with_ratios

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False); "
                         "pass --device cpu to check the benchmark's logic on a CPU")
    for variant in ["", *args.variants]:  # every job checked before minutes go into the first
        build_spec([*args.overrides, *shlex.split(variant)], args.device, "unchecked", 1)
    report = {"device": device_name(torch.device(args.device)), "torch": torch.__version__,
              "warmup_steps": args.warmup, "steps": args.steps,
              "job": job_summary(build_spec(args.overrides, args.device, "unchecked", 1))}
    part = Part(args.out, report)
    with tempfile.TemporaryDirectory(prefix="raymesh-gpu-bench-") as tmp:
        base = part("base", lambda: measure(args, args.overrides, Path(tmp) / "job", args.trace))
        report.update({"overrides": args.overrides, **{k: base.get(k) for k in ("throughput", "memory", "profile")}})
        report["errors"] = {"base": base["error"]} if "error" in base else {}
        part.save()
        titan = (skipped("--torchtitan off") if args.torchtitan == "off" else part("torchtitan", lambda: run_torchtitan(
            report["job"], args.device, args.warmup, args.steps, Path(tmp), args.torchtitan_timeout_s)))
        ratios = report["throughput"] and "error" not in titan
        report["torchtitan"] = with_ratios(report["throughput"], titan) if ratios else titan
        part.save()
        # the abort check before the variants: a lease that runs out should lose a variant, not the check
        report["abort"] = (part("abort", lambda: check_abort(args.device, args.abort_timeout_s))
                           if args.check_abort else None)
        report["variants"] = []
        part.save()
        for i, v in enumerate(args.variants):
            overrides = [*args.overrides, *shlex.split(v)]
            result = part(f"variant {v}", lambda o=overrides, i=i: measure(args, o, Path(tmp) / f"variant-{i}", None))
            if args.torchtitan != "off" and result.get("job", {}).get("float8", "none") != "none":
                result["torchtitan"] = torchtitan_on(part, args, result, Path(tmp) / f"variant-{i}-titan", v)
            report["variants"].append({"overrides": overrides, **result, "variant": v})
            part.save()
        report["ratios"] = suite_ratios(report, args.suite)
    return report


def torchtitan_on(part, args: argparse.Namespace, result: dict, folder: Path, variant: str) -> dict:
    """torchtitan on a variant's job (its float8 recipe included, ``gpu_torchtitan.float8_settings``) in the same
    lease, with the raymesh / torchtitan ratios."""
    from benchmarks.gpu_torchtitan import run_torchtitan, with_ratios

    titan = part(f"torchtitan on {variant}", lambda: run_torchtitan(
        result["job"], args.device, args.warmup, args.steps, folder, args.torchtitan_timeout_s))
    return titan if "error" in titan or "throughput" not in result else with_ratios(result["throughput"], titan)


def suite_ratios(report: dict, suites: list[str]) -> dict:
    """Each suite's figures read against its baseline from the same run: tokens/s and measured peak of each
    setting over the bf16 compiled job's, the default-picked job's MFU and picks, and raymesh's float8 over
    torchtitan's; None where a part failed or did not run."""
    if "issue48" not in suites:
        return {}
    by_name = {name: next((v for v in report["variants"] if v["variant"] == variant), {})
               for name, variant in SUITE_48.items()}
    base = by_name["bf16_compiled"].get("throughput")
    out = {}
    for name, variant in by_name.items():
        t = variant.get("throughput")
        titan = (variant.get("torchtitan") or {}).get("ratio") or {}
        out[name] = {
            "tokens_per_s": t and t["tokens_per_s"], "mfu": t and t["mfu"],
            "vs_bf16_compiled": t and base and t["tokens_per_s"] / base["tokens_per_s"],
            "peak_vs_bf16_compiled": _peak_ratio(variant, by_name["bf16_compiled"]),
            "planner_relative_error": (variant.get("memory") or {}).get("relative_error"),
            "vs_torchtitan": titan.get("tokens_per_s")}
    out["default_picked"]["picked"] = by_name["default_picked"].get("defaults_picked")
    return out


def _peak_ratio(variant: dict, base: dict) -> float | None:
    """A variant's measured peak over the baseline's (None when either has none)."""
    if not variant.get("memory") or not base.get("memory"):
        return None
    return variant["memory"]["measured_peak_bytes"] / base["memory"]["measured_peak_bytes"]


class Part:
    """Runs one part of the benchmark: logs its start and seconds on stderr and turns an exception into
    ``{"error": traceback tail}``; ``save`` rewrites the report so far to ``out``."""

    def __init__(self, out: str | None, report: dict):
        self.out, self.report, self.start = out, report, time.perf_counter()

    def __call__(self, name: str, fn) -> dict:
        import traceback

        began = time.perf_counter()
        print(f"[gpu.py {began - self.start:6.1f}s] {name}: start", file=sys.stderr, flush=True)
        try:
            result = fn()
        except Exception:  # recorded, and the remaining parts still run
            result = {"error": traceback.format_exc()[-4000:]}
        status = "failed" if "error" in result else "done"
        print(f"[gpu.py {time.perf_counter() - self.start:6.1f}s] {name}: {status} in "
              f"{time.perf_counter() - began:.1f}s", file=sys.stderr, flush=True)
        if status == "failed":
            print(result["error"], file=sys.stderr, flush=True)
        return result

    def save(self) -> None:
        """The report so far to ``out``, marked partial (``main`` writes the finished one)."""
        if self.out:
            Path(self.out).write_text(json.dumps({**self.report, "partial": True}, indent=2, default=str))


def markdown(report: dict) -> str:
    """The figures as the README's table (a part that failed: its row says so)."""
    t, m, tt = report["throughput"], report["memory"], report["torchtitan"]
    job = report["job"]
    rows = [("device", report["device"]), ("torch", report["torch"]),
            ("job", f"{job['preset'] or job['arch']} d={job['d_model']} L={job['n_layers']}, seq {job['seq_len']}, "
                    f"batch {job['global_batch_size']}, {job['precision']}, recompute {job['recompute']}"),
            ("steps timed (warm-up left out)", f"{report['steps']} ({report['warmup_steps']})")]
    if t is None:
        rows.append(("raymesh", failed(report["errors"]["base"])))
    else:
        rows += [("raymesh tokens/s (wall clock)", f"{t['tokens_per_s']:,.0f} ({t['wall_tokens_per_s']:,.0f})"),
                 ("raymesh MFU (HFU)", f"{t['mfu']:.2%} ({t['hfu']:.2%})"),
                 ("peak memory measured / predicted", memory_cell(m))]
    if tt.get("error"):
        rows.append(("torchtitan", failed(tt["error"])))
    elif tt["tokens_per_s"] is None:
        rows.append(("torchtitan", f"not run: {tt['reason']}"))
    else:
        rows.append(("torchtitan tokens/s, its MFU", f"{tt['tokens_per_s']:,.0f}, {tt['mfu']:.1%}"))
        if tt.get("ratio"):
            rows.append(("raymesh / torchtitan tokens/s", f"{tt['ratio']['tokens_per_s']:.2f}"))
    if report["abort"] is not None:
        if "error" in report["abort"]:
            rows.append(("abort check", failed(report["abort"]["error"])))
        for variant in report["abort"].get("variants", []):
            rows.append((f"abort check ({variant['backend']}, {variant['env'] or 'default env'})",
                         variant["summary"]))
    lines = ["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if report["variants"]:
        lines += ["", "| job | tokens/s | MFU | peak memory measured / predicted |", "|---|---|---|---|"]
        lines += [variant_row(v) for v in [report, *report["variants"]]]
    if report.get("ratios"):
        lines += ["", "| setting | tokens/s vs bf16 compiled | peak vs bf16 compiled | planner error | vs torchtitan |",
                  "|---|---|---|---|---|"]
        lines += [ratio_row(name, r) for name, r in report["ratios"].items()]
    return "\n".join(lines)


def ratio_row(name: str, r: dict) -> str:
    """One setting's row of the suite's ratios (a dash where a figure is missing)."""
    def cell(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    return (f"| {name} | {cell(r['vs_bf16_compiled'], '.2f')} | {cell(r['peak_vs_bf16_compiled'], '.2f')} | "
            f"{cell(r['planner_relative_error'], '+.1%')} | {cell(r['vs_torchtitan'], '.2f')} |")


def failed(error: str) -> str:
    """A failed part's cell: the last line of its traceback (the exception and its message)."""
    return "failed: " + (error.strip().splitlines() or ["?"])[-1]


def memory_cell(m: dict) -> str:
    return (f"{m['measured_peak_bytes'] / 2**30:.2f} / {m['predicted_peak_bytes'] / 2**30:.2f} GiB "
            f"({m['relative_error']:+.1%})")


def variant_row(v: dict) -> str:
    """One job's row of the variants table: the variant's own fields (over the job above), then its figures."""
    name = v.get("variant") or "job above"
    t = v.get("throughput")
    if t is None:
        return f"| {name} | {failed(v.get('error') or v['errors']['base'])} | | |"
    return f"| {name} | {t['tokens_per_s']:,.0f} | {t['mfu']:.2%} | {memory_cell(v['memory'])} |"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        report = run(args)
    except SpecError as exc:  # a --set or --variant the job file would refuse: its field, value and fix
        raise SystemExit(f"benchmarks/gpu.py: {exc}") from None
    table = markdown(report)
    if report["profile"] is not None:
        table += "\n\n```\n" + report["profile"]["table"] + "\n```"
    text = json.dumps(report, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    print(text)
    print(table, file=sys.stderr)


if __name__ == "__main__":
    main()
