"""``memory.recompute: sqrt`` (Chen et al. 2016): full recompute on every round(√n)-th block; probe and model agree.

One process, a 9-block tiny GPT (√9 = 3, so blocks 0, 3 and 6 are checkpointed): ``ActivationMeter`` measures
the peak bytes saved for backward in a forward under ``sqrt``; the memory model predicts it within 1%, and it
saves a third of what recomputing every block saves, exactly what ``full`` with ``recompute_every: 3`` saves.
"""

from __future__ import annotations

import pytest

from orchestrator.errors import SpecError
from tests.support.jobs import tiny_spec
from tests.support.recompute import measured_saved_bytes, predicted_saved_bytes
from workers.model.gpt import GPT
from workers.model.registry import family, model_config
from workers.parallel.recompute import checkpointed_modules


def _spec(token_data, tmp_path, recompute: str, every: int = 1):
    return tiny_spec(token_data, tmp_path, model={"n_layers": 9}, train={"microbatches": 1},
                     memory={"recompute": recompute, "recompute_every": every})


def test_sqrt_checkpoints_every_third_of_nine_blocks_and_the_model_follows(token_data, tmp_path):
    specs = {name: _spec(token_data, tmp_path, *args)
             for name, args in {"none": ("none",), "sqrt": ("sqrt",), "every3": ("full", 3), "all": ("full",)}.items()}
    runs = [specs[name].worker_dict()["memory"] for name in ("sqrt", "every3")]
    assert [(m["recompute"], m["recompute_every"]) for m in runs] == [("full", 3)] * 2
    measured = {name: measured_saved_bytes(s) for name, s in specs.items()}
    for name, s in specs.items():
        assert predicted_saved_bytes(s) == pytest.approx(measured[name], rel=0.01), name
    assert measured["all"] < measured["sqrt"] < measured["none"] and measured["sqrt"] == measured["every3"]
    saving = measured["none"] - measured["all"]
    assert measured["none"] - measured["sqrt"] == pytest.approx(saving / 3, rel=0.02)


def test_sqrt_runs_full_recompute_on_blocks_0_3_6(token_data, tmp_path):
    worker = _spec(token_data, tmp_path, "sqrt").worker_dict()
    gpt = GPT(model_config(worker["model"]))
    memory = worker["memory"]
    wrapped = checkpointed_modules(gpt, memory["recompute"], family("gpt"), memory["recompute_every"])
    assert wrapped == [gpt.layers[str(i)] for i in (0, 3, 6)]


def test_sqrt_with_recompute_every_names_the_fix(token_data, tmp_path):
    with pytest.raises(SpecError, match=r"memory\.recompute_every.*value 2.*fix: remove memory\.recompute_every"):
        _spec(token_data, tmp_path, "sqrt", 2)
