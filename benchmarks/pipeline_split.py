"""Even against profiled (``parallel.pp_split: auto``) pipeline stages on a model with a heavy output head.

Two jobs train the same GPT (6 blocks of width 32 under a 4096-word head, as ``examples/pp_auto_split.yaml``)
for the same steps on the same 2 pipeline ranks (1F1B, gloo, the Ray-free parity harness's spawned processes,
one spawn for both so they share the machine's state): ``even`` (3 + 3 blocks) and ``auto``. Reported per
job, medians over the steps after warm-up:

- ``bubble``: the measured bubble of the step timeline (``orchestrator.planning.bubble.measured_bubble``:
  each pp rank's idle share of the step window, the figure ``raymesh report`` and Prometheus show);
- ``imbalance``: ``1 - mean(busy) / max(busy)`` over the pp ranks' busy seconds, the part of the bubble the
  split decides (what tests/integration/test_pipeline_split.py asserts on);
- ``step_s`` (slowest rank) and ``auto``'s ratio against ``even``.

    python benchmarks/pipeline_split.py --data data/stdlib --steps 20 --out benchmarks/results/pipeline_split.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import write_result  # noqa: E402
from orchestrator.planning.bubble import measured_bubble, step_events  # noqa: E402
from orchestrator.planning.stage_split import auto_split, pin_split  # noqa: E402
from tests.support.jobs import tiny_spec  # noqa: E402
from tests.support.parity_harness import run_layouts  # noqa: E402
from workers.diagnostics.timeline import busy_seconds  # noqa: E402

WARMUP = 2
MODEL = {"n_layers": 6, "vocab_size": 4096}


def timeline(run, step: int) -> list[dict]:
    """The pipeline events of the ``step``-th step (0-based) of one replica."""
    events = [e for steps in run.results.values() for e in steps[step]["timeline"]]
    return step_events(events, events[0]["step"])


def imbalance(events: list[dict]) -> float:
    busy: dict[int, list] = defaultdict(list)
    for e in events:
        busy[e["pp_rank"]].append(e)
    seconds = [busy_seconds(v) for v in busy.values()]
    return 1 - statistics.fmean(seconds) / max(seconds)


def measure(data: Path, steps: int, batch: int) -> dict:
    tmp, specs = Path(tempfile.mkdtemp(prefix="split-bench-")), {}
    for split in ("even", "auto"):
        specs[split] = tiny_spec(data, tmp / split, model=MODEL, parallel={"pp": 2, "pp_split": split},
                                 train={"steps": steps, "global_batch_size": batch, "microbatches": 4},
                                 metrics={"timeline": True})
    specs = {name: pin_split(spec) for name, spec in specs.items()}  # `auto` profiled once, as the controller does
    runs = run_layouts([s.worker_dict() for s in specs.values()], 2, steps, timeout_s=1800)
    rows = {}
    for name, run in zip(specs, runs):
        kept = range(WARMUP, steps)
        events = [timeline(run, i) for i in kept]
        rows[name] = {"split": specs[name].worker_dict()["parallel"]["pp_split"],
                      "bubble": statistics.median(measured_bubble(e) for e in events),
                      "imbalance": statistics.median(imbalance(e) for e in events),
                      "step_s": statistics.median(run.step_s[WARMUP:]),
                      "final_loss": run.losses[-1]}
    rows["auto"]["step_vs_even"] = rows["auto"]["step_s"] / rows["even"]["step_s"]
    rows["auto"]["profile"] = auto_split(specs["auto"]).describe()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="global batch (4 microbatches)")
    ap.add_argument("--out", default="benchmarks/results/pipeline_split.json")
    args = ap.parse_args()
    rows = measure(args.data, args.steps, args.batch)
    print(json.dumps(rows, indent=2))
    write_result(args.out, rows, args.data)


if __name__ == "__main__":
    main()
