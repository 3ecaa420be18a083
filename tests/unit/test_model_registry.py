"""The model registry: families are found by ``model.arch``; an unknown arch says what is registered."""

from __future__ import annotations

import copy
from typing import Literal

import pytest
import torch
from torch import nn

from orchestrator.spec.model import ModelSpec
from tests.support.jobs import tiny_spec
from workers.model.config import ModelConfig
from workers.model.gpt import GPT
from workers.model.registry import ModelFamily, build_model, families, family, model_config, register
from workers.parallel.layout import layers_of_stage
from workers.parallel.parallelize import build_parts
from workers.parallel.recompute import checkpointed_modules
from workers.spec import WorkerSpec


def test_gpt_is_registered_and_builds_from_its_config():
    assert "gpt" in families()
    model = build_model(ModelConfig(d_model=32, n_heads=4, n_layers=2))
    assert isinstance(model, GPT) and len(model.layers) == 2
    assert family("gpt").hook("cut_stage").__name__ == "cut_stage"


def test_unknown_arch_names_the_field_and_the_registered_families():
    with pytest.raises(ValueError, match=r"model.arch 'mamba' is not a registered model family; pick one of "
                                         r"\['deepseek_v3', 'gpt'"):
        family("mamba")


def test_a_second_family_plugs_in_by_registering():
    register(ModelFamily(arch="test-tiny", config=ModelConfig, build=GPT))
    assert family("test-tiny").build is GPT
    with pytest.raises(ValueError, match="already registered"):
        register(ModelFamily(arch="test-tiny", config=ModelConfig, build=lambda cfg: None))


def test_missing_hook_names_the_arch_and_the_step():
    with pytest.raises(KeyError, match="registers no 'pipeline_schedule' hook"):
        family("gpt").hook("pipeline_schedule")


def test_model_spec_declares_no_shape_field_of_its_own():
    """One declaration of the shape: the orchestrator's section adds only fine-tuning."""
    assert set(ModelSpec.model_fields) - set(ModelConfig.model_fields) == {"lora", "preset", "init_from"}
    assert ModelSpec().arch == "gpt"


def test_model_config_takes_the_worker_dict_model_section():
    cfg = model_config({"d_model": 32, "n_heads": 4, "d_ff": 64, "lora": None})
    assert cfg.ffn_dim == 64 and cfg.head_size == 8


# -- a second family, registered here, built by the unchanged builder ------------------------------------------


class ToyConfig(ModelConfig):
    arch: Literal["toy"] = "toy"


class ToyBlock(nn.Module):
    """Counts its forwards, so the test sees recompute run it again in backward."""

    def __init__(self, d: int):
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + torch.tanh(self.mix(x))


class Toy(nn.Module):
    """Not a GPT: its blocks live in ``stack``, and there is no norm, attention or head."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.stack = nn.ModuleDict({str(i): ToyBlock(cfg.d_model) for i in range(cfg.n_layers)})

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for block in self.stack.values():
            h = block(h)
        return h


def toy_cut_stage(model: Toy, stage: int, n_stages: int, split=None) -> Toy:
    part = copy.deepcopy(model)
    keep = {str(i) for i in layers_of_stage(stage, n_stages, model.cfg.n_layers, split)}
    part.stack = nn.ModuleDict({k: b for k, b in part.stack.items() if k in keep})
    if stage != 0:
        part.embed = None
    return part


def toy_blocks(model: Toy) -> list[nn.Module]:
    return list(model.stack.values())


TOY = ModelFamily(
    arch="toy", config=ToyConfig, build=Toy, lora_targets=("mix",),
    recompute_targets={"full": "", "selective": "mix"},
    hooks={"cut_stage": f"{__name__}:toy_cut_stage", "blocks": f"{__name__}:toy_blocks"},
)


class _Axis:
    """A one-rank stand-in for a mesh axis: ``build_parts`` only asks where this rank sits."""

    def __init__(self, rank: int):
        self.rank = rank

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return 1


def _toy_spec(tmp_path, recompute: str) -> WorkerSpec:
    job = tiny_spec(tmp_path / "tokens", tmp_path, parallel={"device": "cpu", "pp": 2, "pp_schedule": "1f1b"},
                    memory={"recompute": recompute})
    raw = job.worker_dict()  # JobSpec knows only gpt; the worker side takes any registered arch
    # the toy's shape from its config class's own defaults, beside the job's fine-tuning fields (none)
    raw["model"] = {**ToyConfig(d_model=16, n_layers=2, vocab_size=32).model_dump(), "init_from": None, "lora": None}
    raw["parallel"]["pp_split"] = [1, 1]  # the layers per stage of this model, as worker_dict resolves them
    return WorkerSpec.from_dict(raw)


def test_the_builder_cuts_and_recomputes_a_registered_second_family(tmp_path):
    register(TOY)
    spec = _toy_spec(tmp_path, "full")
    assert isinstance(spec.model, ToyConfig)  # parsed by the family's own config class
    parts = build_parts(spec, {"pp": _Axis(1), "dp": _Axis(0)}, torch.device("cpu"))
    (stage,) = parts.modules
    assert (parts.stage_ids, parts.n_stages) == ([1], 2)
    assert isinstance(stage, Toy) and stage.embed is None and list(stage.stack) == ["1"]
    assert checkpointed_modules(stage, "full", TOY) == [stage.stack["1"]]
    stage(torch.randn(2, 4, 16, requires_grad=True)).sum().backward()
    assert stage.stack["1"].calls == 2  # forward, then again in backward: the block was checkpointed


def test_selective_recompute_wraps_the_family_target(tmp_path):
    register(TOY)
    parts = build_parts(_toy_spec(tmp_path, "selective"), {"pp": _Axis(0), "dp": _Axis(0)}, torch.device("cpu"))
    (stage,) = parts.modules
    assert stage.embed is not None and list(stage.stack) == ["0"]
    assert checkpointed_modules(stage, "selective", TOY) == [stage.stack["0"].mix]


def test_a_recompute_policy_the_family_does_not_declare_names_the_field():
    bare = ModelFamily(arch="toy-bare", config=ToyConfig, build=Toy, hooks=TOY.hooks)
    with pytest.raises(ValueError, match=r"memory.recompute 'full' is not declared by model.arch 'toy-bare'"):
        checkpointed_modules(Toy(ToyConfig(n_layers=1)), "full", bare)
