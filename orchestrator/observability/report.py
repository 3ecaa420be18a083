"""``raymesh report RUN_DIR``: PNG charts and an ``index.html`` from the files a run left behind.

Reads ``summary.json``, ``steps.jsonl`` (under ``data.mix`` with each step's samples per source) and, when the
job recorded pipeline events, ``timeline.jsonl``. Figures are drawn with matplotlib's object API on an
Agg canvas, so building a report touches no pyplot global state and needs no
display. The run dir and the output may be object-store URLs (``s3://...``): each file is read, and each
PNG and the page written, as one whole object through fsspec (`workers.storage.location`).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from orchestrator.observability.run_records import kept_steps, read_jsonl
from orchestrator.planning.bubble import (
    PIPELINE_KINDS,
    measured_bubble,
    ordered_bubble,
    step_events,
    theoretical_bubble,
)
from workers.storage import is_url, location

PHASES = ("data", "compute", "communication", "bubble", "optimizer", "checkpoint")
KIND_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
KIND_NAMES = {"F": "F forward", "B": "B backward", "W": "W weight grad"}
DPI = 110


def _load(run_dir: Path) -> tuple[dict, list[dict], list[dict] | None]:
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise FileNotFoundError(
            f"no summary.json in run dir {run_dir}: `raymesh report` reads the run_dir of a `raymesh run`; "
            f"write one with `raymesh run JOB.yaml --set run_dir={run_dir}` "
            f"or `raymesh run JOB.yaml --summary-json {summary_path}`"
        )
    summary = json.loads(summary_path.read_text())
    steps_path, timeline_path = run_dir / "steps.jsonl", run_dir / "timeline.jsonl"
    steps = kept_steps(read_jsonl(steps_path)) if steps_path.is_file() else []
    timeline = read_jsonl(timeline_path) if timeline_path.is_file() else None
    return summary, steps, timeline


def _figure(height: float = 4.2) -> Figure:
    fig = Figure(figsize=(9, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _step_axis(ax) -> None:
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _recovery_label(record: dict) -> str:
    """What failed in a recovery: the rank lost, the parameter-server shard restarted, or only the kind where no
    rank died (a NaN step's rollback records rank -1, which no rank is)."""
    if "shard" in record:
        return f"{record['kind']} (shard {record['shard']})"
    return record["kind"] if record["rank"] < 0 else f"{record['kind']} (rank {record['rank']})"


def _mark_recoveries(ax, recoveries: list[dict]) -> None:
    """Dashed vertical line per recovery step, labelled with its kinds, so dips line up with faults."""
    by_step: dict[int, list[str]] = {}
    for r in recoveries:
        by_step.setdefault(r["at_step"], []).append(_recovery_label(r))
    for i, (step, labels) in enumerate(sorted(by_step.items())):
        ax.axvline(step, color="#C44E52", linestyle="--", linewidth=1, label="recovery" if i == 0 else None)
        ax.annotate(", ".join(labels), (step, 0.98), xycoords=ax.get_xaxis_transform(), xytext=(-3, 0),
                    textcoords="offset points", rotation=90, va="top", ha="right", fontsize=8, color="#C44E52")


def _loss(summary: dict, steps: list[dict]) -> Figure:
    if steps:
        x, y = [r["step"] for r in steps], [r["loss"] for r in steps]
    else:  # summary only: its losses are the last len(losses) steps (a resumed run starts late)
        y = summary["losses"]
        x = list(range(summary["steps"] - len(y) + 1, summary["steps"] + 1))
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(x, y, color="#4C72B0", linewidth=1.5, label="loss")
    held = summary.get("eval_losses") or []  # eval.every: the held-out loss at the steps that evaluated
    if held:
        ax.plot([e["step"] for e in held], [e["loss"] for e in held], color="#DD8452", linewidth=1.5, marker="o",
                markersize=4, label="held-out loss")
    _mark_recoveries(ax, summary.get("recoveries", []))
    ax.set(ylabel="loss", title="Training loss" + (" and held-out loss" if held else ""))
    _step_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return fig


def _throughput(summary: dict, steps: list[dict]) -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot([r["step"] for r in steps], [r["tokens_per_s"] for r in steps], color="#55A868",
            linewidth=1.5, label="per step")
    ax.axhline(summary["tokens_per_s"], color="gray", linestyle=":", label=f"run mean {summary['tokens_per_s']:,.0f}")
    _mark_recoveries(ax, summary.get("recoveries", []))
    ax.set(ylabel="tokens / s", title="Throughput", ylim=(0, None))
    _step_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return fig


def phase_means(record: dict) -> dict[str, float]:
    """A step's phase times averaged over its ranks: from each rank's own (a step with per-rank detail) or as the
    ranks reduced them (a large job's other steps)."""
    if "phases" not in record:
        return record["ranks"]["phases_mean"]
    found = {p for phases in record["phases"].values() for p in phases}
    return {p: sum(ph.get(p, 0.0) for ph in record["phases"].values()) / len(record["phases"]) for p in found}


def _step_breakdown(steps: list[dict]) -> Figure:
    """Stacked phase times (mean over ranks) against the measured wall time of the step."""
    x = [r["step"] for r in steps]
    means = [phase_means(r) for r in steps]
    found = {p for m in means for p in m}
    names = [p for p in PHASES if p in found] + sorted(found - set(PHASES))
    fig = _figure()
    ax = fig.add_subplot()
    bottom = [0.0] * len(steps)
    for name in names:
        mean = [m.get(name, 0.0) for m in means]
        ax.bar(x, mean, bottom=bottom, width=0.9, linewidth=0, label=name)
        bottom = [b + m for b, m in zip(bottom, mean)]
    ax.plot(x, [r["step_s"] for r in steps], color="black", linewidth=1, marker="." if len(x) <= 50 else None,
            label="step wall time")
    ax.set(ylabel="seconds", title="Step time by phase (mean over ranks)")
    _step_axis(ax)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig


def _expert_load(steps: list[dict]) -> Figure:
    """Per MoE layer, each expert's share of the step's kept assignments over time (stacked; equal bands are
    perfect balance), and the step's drop fraction on a second axis."""
    layers = sorted({name for r in steps for name in r.get("moe", {})})
    fig = _figure(height=2.6 * len(layers) + 0.6)
    for i, layer in enumerate(layers):
        ax = fig.add_subplot(len(layers), 1, i + 1)
        rows = [(r["step"], r["moe"][layer]) for r in steps if layer in r.get("moe", {})]
        x = [step for step, _ in rows]
        loads = [figures["tokens_per_expert"] for _, figures in rows]
        shares = [[load[e] / (sum(load) or 1) for load in loads] for e in range(len(loads[0]))]
        ax.stackplot(x, shares, labels=[f"expert {e}" for e in range(len(shares))], linewidth=0)
        drops = ax.twinx()
        drops.plot(x, [figures["drop_fraction"] for _, figures in rows], color="black", linewidth=1,
                   label="dropped")
        drops.set(ylabel="dropped", ylim=(0, 1))
        ax.set(ylabel="share of tokens", title=f"Expert load: {layer}", ylim=(0, 1))
        _step_axis(ax)
        ax.legend(loc="upper left", bbox_to_anchor=(1.08, 1), fontsize=7)
    return fig


def _data_mix(steps: list[dict]) -> Figure:
    """Under ``data.mix``: each source's share of the samples supplied so far, per step (the counts steps.jsonl
    carries), so a reader sees the shares settle on the weights the job asked for."""
    rows = [(r["step"], r["data_mix"]) for r in steps if r.get("data_mix")]
    fig = _figure()
    ax = fig.add_subplot()
    for source in rows[-1][1]:
        ax.plot([step for step, _ in rows], [mix.get(source, 0) / (sum(mix.values()) or 1) for _, mix in rows],
                linewidth=1.5, label=source)
    ax.set(ylabel="share of samples so far", title="Data mixture", ylim=(0, 1))
    _step_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    return fig


def last_mix(summary: dict, steps: list[dict]) -> tuple[int, dict[str, int]] | None:
    """``(step, samples per source)`` through the run's last recorded step under ``data.mix`` (steps.jsonl's, else
    the summary's); None for a run without a mixture."""
    mixed = [r for r in steps if r.get("data_mix")]
    if mixed:
        return mixed[-1]["step"], mixed[-1]["data_mix"]
    return (summary["steps"], summary["data_mix"]) if summary.get("data_mix") else None


def mix_text(mix: dict[str, int]) -> str:
    """``source count (share), ...``: the samples each source supplied."""
    total = sum(mix.values()) or 1
    return ", ".join(f"{source} {count:,} ({count / total:.1%})" for source, count in mix.items())


def _byte_unit(largest: float) -> tuple[str, float]:
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "bytes", 1


def _memory(summary: dict, steps: list[dict]) -> Figure:
    peak = {int(k): v for k, v in summary.get("peak_memory_bytes", {}).items()}
    current: dict[int, list[tuple[int, int]]] = {}
    for r in steps:
        for rank, mem in r.get("memory", {}).items():
            current.setdefault(int(rank), []).append((r["step"], mem["current_bytes"]))
    unit, size = _byte_unit(max([*peak.values(), *(b for pts in current.values() for _, b in pts), 1]))
    fig = _figure(4.2 if not current else 4.6)
    axes = fig.subplots(1, 2, width_ratios=[1, 2]) if current else [fig.add_subplot()]
    ranks = sorted(peak)
    bars = axes[0].bar([str(r) for r in ranks], [peak[r] / size for r in ranks], color="#8172B3")
    axes[0].bar_label(bars, fmt="%.3g", fontsize=7)
    axes[0].set(xlabel="rank", ylabel=unit, title="Peak memory per rank")
    if current:
        ax = axes[1]
        for rank in sorted(current):
            pts = current[rank]
            ax.plot([s for s, _ in pts], [b / size for _, b in pts], linewidth=1, label=f"rank {rank}")
        ax.set(ylabel=unit, title="Current memory after each step")
        _step_axis(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncols=max(1, len(current) // 8), loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def _pipeline(events: list[dict], layout: dict, step: int, bubble: dict) -> Figure:
    """Gantt chart of one step of one replica: where each pp rank computes and where it waits."""
    t0 = min(e["start"] for e in events)
    window = max(e["end"] for e in events) - t0
    pp_ranks = sorted({e["pp_rank"] for e in events})
    stages = {p: sorted({e["stage"] for e in events if e["pp_rank"] == p}) for p in pp_ranks}
    fig = _figure(1.2 + 0.55 * len(pp_ranks))
    ax = fig.add_subplot()
    axis_points = 9 * 72 * 0.85  # roughly how wide the x axis is, in points, to skip labels that would not fit
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in events:
        width = e["end"] - e["start"]
        spans.setdefault((e["pp_rank"], e["kind"]), []).append((e["start"] - t0, width))
        label = str(e["microbatch"]) + (f"·s{e['stage']}" if len(stages[e["pp_rank"]]) > 1 else "")
        if width / window * axis_points >= 5.0 * len(label) + 2:
            ax.text(e["start"] - t0 + width / 2, e["pp_rank"], label, ha="center", va="center", fontsize=7,
                    color="white")
    for (pp_rank, kind), xranges in spans.items():  # one collection per row and kind: fast for thousands of events
        ax.broken_barh(xranges, (pp_rank - 0.35, 0.7), facecolors=KIND_COLORS.get(kind, "gray"), edgecolor="white",
                       linewidth=0.5)
    names = {p: f"{'stage' if len(stages[p]) == 1 else 'stages'} {', '.join(map(str, stages[p]))}" for p in pp_ranks}
    ax.set_yticks(pp_ranks, [f"pp rank {p} ({names[p]})" for p in pp_ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, window)
    ax.set_xlabel("seconds from the step's first event")
    kinds = [k for k in KIND_COLORS if any(e["kind"] == k for e in events)]
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, title="label: microbatch")
    theory = "n/a" if bubble["theoretical"] is None else f"{bubble['theoretical']:.1%}"
    order = "" if bubble["ordered"] is None else f", its order {bubble['ordered']:.1%}"
    ax.set_title(
        f"{bubble['schedule']}, step {step}: measured bubble {bubble['measured']:.1%} vs theory {theory}{order} "
        f"(p={layout.get('pp')}, m={layout.get('microbatches')}, v={layout.get('virtual_stages', 1)})",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)
    return fig


def _theory(layout: dict) -> float | None:
    if "pp" not in layout or "microbatches" not in layout:
        return None
    return theoretical_bubble(layout["pp"], layout["microbatches"], layout.get("virtual_stages", 1))


def _ordered(events: list[dict]) -> float | None:
    """``ordered_bubble`` of a synchronous pipeline's step; None for an asynchronous one (PipeDream's backward of
    a microbatch may belong to an earlier step's forward, so one step's order has no replay)."""
    try:
        return ordered_bubble(events)
    except ValueError:
        return None


def _numbers(summary: dict, bubble: dict, comm: dict | None = None,
             mix: tuple[int, dict[str, int]] | None = None) -> list[tuple[str, str]]:
    lay = summary.get("layout", {})
    rec = summary.get("recoveries", [])
    peak = summary.get("peak_memory_bytes", {})
    unit, size = _byte_unit(max(peak.values(), default=1))
    rows = [
        ("status", str(summary.get("status", "-"))),
        ("steps", str(summary["steps"])),
        ("final loss", "-" if summary.get("final_loss") is None else f"{summary['final_loss']:.4f}"),
        *([(f"held-out loss (step {summary['eval_losses'][-1]['step']})",
            f"{summary['eval_losses'][-1]['loss']:.4f}")] if summary.get("eval_losses") else []),
        ("tokens / s", f"{summary['tokens_per_s']:,.0f}"),
        ("layout", f"dp={lay.get('dp')} × pp={lay.get('pp')} × tp={lay.get('tp')} "
                   f"({lay.get('world_size')} ranks), zero={lay.get('zero')}"),
        ("pipeline", f"{lay.get('pp_schedule')}, v={lay.get('virtual_stages', 1)}, "
                     f"microbatches={lay.get('microbatches', '-')}"),
        ("recoveries", f"{len(rec)} (lost steps {sum(r['lost_steps'] for r in rec)}"
                       + (f", mean MTTR {sum(r['mttr_s'] for r in rec) / len(rec):.1f} s)" if rec else ")")),
        ("checkpoints", str(len(summary.get("checkpoints", [])))),
        ("max peak memory", f"{max(peak.values(), default=0) / size:.1f} {unit}"),
    ]
    if mix:
        rows.append((f"data mix (samples per source through step {mix[0]})", mix_text(mix[1])))
    if comm:
        unit, size = _byte_unit(max(comm.values(), default=1))
        rows.append(("bytes sent per step (busiest rank, last step)",
                     ", ".join(f"{dim} {sent / size:.3g} {unit}" for dim, sent in comm.items())))
    if bubble["theoretical"] is not None:
        rows.append(("bubble (theory)", f"{bubble['theoretical']:.1%}"))
    if bubble["measured"] is not None:
        rows.append((f"bubble (measured, step {bubble['step']})", f"{bubble['measured']:.1%}"))
    if bubble["ordered"] is not None:
        rows.append((f"bubble (step {bubble['step']}'s order at ideal costs; measured minus it is messaging "
                     "and imbalance)", f"{bubble['ordered']:.1%}"))
    return rows


CAPTIONS = {
    "loss.png": "Training loss per step (and the held-out loss where the job evaluates); dashed red lines mark "
                "recoveries and their kind.",
    "throughput.png": "Tokens per second per step against the run mean; recoveries marked.",
    "step_breakdown.png": "Where a step's time goes: phases averaged over ranks, stacked, against the wall time.",
    "memory.png": "Peak accelerator/host memory per rank, and current memory after each step.",
    "expert_load.png": "Mixture of experts: each MoE layer's share of tokens per expert per step (stacked; equal "
                       "bands are perfect balance) and the fraction of assignments dropped for capacity.",
    "data_mix.png": "Data mixture (data.mix): each source's share of the samples supplied so far, per step.",
    "pipeline_timeline.png": "One step of one replica: forward (F), backward (B) and weight-gradient (W) passes "
                             "per pipeline rank, labelled by microbatch; gaps are the bubble.",
}


def _html(run_dir: Path, summary: dict, bubble: dict, pngs: list[Path], comm: dict | None = None,
          mix: tuple[int, dict[str, int]] | None = None) -> str:
    esc = html.escape
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _numbers(summary, bubble, comm, mix))
    figures = "".join(
        f'<figure><img src="{esc(p.name)}" alt="{esc(p.stem)}">'
        f'<figcaption>{esc(CAPTIONS[p.name])}</figcaption></figure>'
        for p in pngs
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>raymesh report: {esc(run_dir.name)}</title><style>"
        "body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}th,td{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}"
        "img{max-width:100%}figure{margin:2em 0}figcaption{color:#555;font-size:0.9em}"
        f"</style></head><body><h1>raymesh report</h1><p>{esc(str(run_dir))}</p>"
        f"<table>{rows}</table>{figures}</body></html>\n"
    )


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, step: int | None = None) -> dict:
    """Write the report's PNGs and ``index.html`` into ``out_dir`` (default ``RUN_DIR/report``).

    ``step`` picks the step of the pipeline timeline (default: the last one
    recorded). Returns ``{"pngs": [...], "html": ..., "bubble": {"step",
    "measured", "ordered", "theoretical", "schedule"}, "data_mix": (step, {source: samples}) or None}``; step,
    measured and ordered (``ordered_bubble``) are None without a ``timeline.jsonl``, ordered also for an
    asynchronous pipeline.
    """
    run_dir = location(run_dir)
    out = location(out_dir) if out_dir is not None else run_dir / "report"
    summary, steps, timeline = _load(run_dir)
    timeline = [e for e in timeline or () if e["kind"] in PIPELINE_KINDS]  # the pipeline chart's events
    layout = summary.get("layout", {})
    bubble = {"step": None, "measured": None, "ordered": None, "theoretical": _theory(layout),
              "schedule": layout.get("pp_schedule")}
    figures = {"loss.png": _loss(summary, steps)}
    if steps:
        figures["throughput.png"] = _throughput(summary, steps)
        figures["step_breakdown.png"] = _step_breakdown(steps)
    if any("moe" in r for r in steps):
        figures["expert_load.png"] = _expert_load(steps)
    if any(r.get("data_mix") for r in steps):
        figures["data_mix.png"] = _data_mix(steps)
    figures["memory.png"] = _memory(summary, steps)
    if timeline:
        recorded = sorted({e["step"] for e in timeline})
        chosen = recorded[-1] if step is None else step
        if chosen not in recorded:
            raise ValueError(f"step {chosen} is not in {run_dir / 'timeline.jsonl'}; recorded steps: {recorded}")
        events = step_events(timeline, chosen)
        bubble.update(step=chosen, measured=measured_bubble(events), ordered=_ordered(events))
        figures["pipeline_timeline.png"] = _pipeline(events, layout, chosen, bubble)
    if not is_url(out):  # an object store has no directories to make
        out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for name, fig in figures.items():
        with (out / name).open("wb") as f:
            fig.savefig(f, dpi=DPI, format="png")
        pngs.append(out / name)
    index = out / "index.html"
    mix = last_mix(summary, steps)
    index.write_text(_html(run_dir, summary, bubble, pngs, steps[-1].get("comm_bytes") if steps else None, mix))
    return {"pngs": [str(p) for p in pngs], "html": str(index), "bubble": bubble, "data_mix": mix}
