"""``memory.recompute_every``: recompute every k-th block only; the probe and the memory model agree on the saving.

One process, the tiny GPT: ``ActivationMeter`` measures the peak bytes saved for backward in a forward with
``full`` recompute on every block, every second block and none; the memory model (``estimate.layer_bytes``
per layer) predicts each within 1%, and every second block saves half of what recomputing saves.
"""

from __future__ import annotations

import pytest

from orchestrator.errors import SpecError
from tests.support.jobs import tiny_spec
from tests.support.recompute import measured_saved_bytes, predicted_saved_bytes
from workers.model.gpt import GPT
from workers.model.registry import family, model_config
from workers.parallel.recompute import checkpointed_modules


def test_every_second_block_saves_half_of_what_full_recompute_saves(token_data, tmp_path):
    def spec(recompute: str, every: int = 1):
        return tiny_spec(token_data, tmp_path, memory={"recompute": recompute, "recompute_every": every},
                         train={"microbatches": 1})

    runs = {name: spec(*args) for name, args in {"none": ("none",), "every2": ("full", 2), "all": ("full",)}.items()}
    measured = {name: measured_saved_bytes(s) for name, s in runs.items()}
    for name, s in runs.items():
        assert predicted_saved_bytes(s) == pytest.approx(measured[name], rel=0.01), name
    assert measured["all"] < measured["every2"] < measured["none"]
    saving = measured["none"] - measured["all"]
    assert measured["none"] - measured["every2"] == pytest.approx(saving / 2, rel=0.02)


def test_recompute_every_blocks_by_global_index(token_data, tmp_path):
    gpt = GPT(model_config(tiny_spec(token_data, tmp_path).worker_dict()["model"]))
    del gpt.layers["0"]  # a later pipeline stage keeps layers 1..3 under their global names
    assert checkpointed_modules(gpt, "full", family("gpt"), 2) == [gpt.layers["2"]]


def test_recompute_every_without_a_policy_names_the_fix(token_data, tmp_path):
    with pytest.raises(SpecError, match=r"memory\.recompute_every.*value 2.*fix: set memory\.recompute: full"):
        tiny_spec(token_data, tmp_path, memory={"recompute_every": 2})
