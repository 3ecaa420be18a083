"""The layout picker searches uneven stage splits (``pp_split: auto``'s program over the planner's unit costs).

- a heavy output head: the even split's last stage is the slowest, so the picker runs the pipeline on the
  program's split, ranks the even one behind it, and ``raymesh plan`` prints the split and the override;
- memory: where the even split's first rank (the most microbatches in flight) does not fit, the search prices
  the fastest split that fits (``Evaluator.fitting_split``) and picks it;
- a ``pp_split: auto`` job is searched on the profiled costs ``auto_split`` uses, so the picker's split is the
  run's own.
"""

from __future__ import annotations

from dataclasses import replace

import yaml

from orchestrator.cli import main
from orchestrator.planning import layout_search as ls
from orchestrator.planning.layout_picker import pick_layout, plan_gpu
from orchestrator.planning.stage_split import auto_split, unit_times
from orchestrator.spec import JobSpec

# a 65,536-word head costs ~18 blocks of width 256; slow links price data parallelism out, one head tp out
HEAVY_HEAD = {"data": {"path": "/absent/data"},
              "model": {"d_model": 256, "n_layers": 8, "n_heads": 8, "seq_len": 256, "vocab_size": 65536},
              "train": {"global_batch_size": 16, "microbatches": 16}, "plan": {"intra_node_gbps": 1}}
# a light head: the program's time-balanced split is the even one; rank 0 keeps 2 microbatches in flight
LIGHT_HEAD = {"data": {"path": "/absent/data"},
              "model": {"d_model": 256, "n_layers": 8, "n_heads": 1, "seq_len": 1024, "vocab_size": 512},
              "train": {"global_batch_size": 8, "microbatches": 8}}


def test_picker_runs_the_pipeline_on_the_balanced_split():
    spec = JobSpec.from_dict(HEAVY_HEAD)
    choice = pick_layout(spec, 1, 2, 10**11)
    won = choice.candidate.layout
    assert (won.pp, won.split) == (2, (7, 1)) and choice.spec.stage_split == (7, 1)
    even = next(c for c in choice.result.best if c.layout == replace(won, split=None))
    assert even.step_s > choice.candidate.step_s  # the head's stage sets the pace of the even split
    assert even.time.compute > choice.candidate.time.compute


def test_plan_prints_the_picked_split(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(HEAVY_HEAD))
    assert main(["plan", str(job), "--nodes", "1", "--gpus-per-node", "2", "--gpu-mem", "100GB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("picked dp=1 pp=2 ") and " pp_split=[7, 1] " in out
    assert "pp_split [7, 1] layers per stage" in out  # the per-rank table of the picked job
    assert "split=even: " in out  # why the even split lost
    assert "--set parallel.pp_split=[7,1]" in out


def test_search_fits_memory_with_an_uneven_split():
    spec = JobSpec.from_dict(LIGHT_HEAD)
    shape, units = ls.Shape.of(spec), unit_times(spec)
    assert ls.balanced_layers(units, 2) == (4, 4)
    ev = ls.Evaluator(shape, plan_gpu(spec, 2, 10**11))
    even = ls.Layout(1, 1, 2, micro_batch=1)
    limit = ev.peak(even)[0] - 1  # the even split misses by a byte
    g = plan_gpu(spec, 2, int(limit / 0.9) + 1)
    space = {"zeros": (0,), "recomputes": ("none",), "even_splits": True}
    assert not [c for c in ls.search(shape, 2, g, **space).best if c.layout.pp == 2]
    result = ls.search(shape, 2, g, units=units, **space)
    best = result.best[0]
    assert best.layout.pp == 2 and best.layout.split[0] < 4  # layers moved off the rank with most in flight
    assert best.peak <= result.limit < ev.peak(even)[0]
    assert replace(best.layout, split=None) in [c.layout for c in result.too_big]


def test_an_auto_job_is_searched_on_the_costs_auto_split_uses():
    """``pp_split: auto``: the picker's split of a pp=2 layout is the one the run's own program makes."""
    raw = {**HEAVY_HEAD, "model": {**HEAVY_HEAD["model"], "d_model": 32, "n_heads": 4, "seq_len": 32,
                                   "vocab_size": 4096, "n_layers": 6},
           "parallel": {"pp": 2, "pp_split": "auto"}, "train": {"global_batch_size": 8, "microbatches": 4}}
    spec = JobSpec.from_dict(raw)
    units = unit_times(spec)
    chosen = auto_split(spec)
    assert units.layers == tuple(u.time_s for u in chosen.costs.layers)
    assert ls.balanced_layers(units, 2) == chosen.split
