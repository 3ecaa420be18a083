"""One declaration per job-file section: the controller's `JobSpec` and a rank's `WorkerSpec` read each field a
rank reads from the same class body (`workers/contract/sections.py`), and a rank refuses a dict that leaves a
field out instead of filling in a default of its own."""

from __future__ import annotations

import inspect
import typing

import pytest
from pydantic import BaseModel

from orchestrator.spec import JobSpec
from orchestrator.spec.model import ModelSpec
from workers.contract import sections
from workers.contract.fields import Section
from workers.model.config import ModelConfig
from workers.spec import SECTIONS, WorkerSpec

# the fields a driver class narrows for the job file, taking the contract's default: the job file offers the
# built-in objectives (a rank runs any registered one), and model.moe gets its SpecError checks (MoESpec)
NARROWED = {("train", "objective"), ("model", "moe")}
# every contract section and where the job file holds it
PLACES = {**{name: (name,) for name in SECTIONS}, "finetune": ("model",), "offload": ("memory", "offload"),
          "lora": ("model", "lora"), "mix": ("data", "mix"), "resize": ("parameter_server", "resize"),
          "batch_ramp": ("train", "batch_ramp")}
CONTRACT = {"finetune": sections.FineTuningSection, "offload": sections.OffloadSection,
            "lora": sections.LoraSection, "mix": sections.MixSource, "resize": sections.PSResize,
            "batch_ramp": sections.BatchRampSection, **SECTIONS}


def _model_in(annotation) -> type[BaseModel]:
    """The section class of a field's annotation (``X``, ``X | None``, ``list[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(m for m in map(_model_in_or_none, typing.get_args(annotation)) if m is not None)


def _model_in_or_none(annotation) -> type[BaseModel] | None:
    try:
        return _model_in(annotation)
    except StopIteration:
        return None


def _driver_class(path: tuple[str, ...]) -> type[BaseModel]:
    """The class `JobSpec` validates the job file's `path` with."""
    model: type[BaseModel] = JobSpec
    for part in path:
        model = _model_in(model.model_fields[part].annotation)
    return model


def _declaring(cls: type[BaseModel], field: str) -> list[type]:
    """The classes along ``cls``'s MRO whose own body declares ``field``."""
    return [c for c in cls.__mro__ if field in inspect.get_annotations(c)]


def test_every_contract_section_is_declared_once_in_the_torch_free_contract():
    declared = {c for c in vars(sections).values() if isinstance(c, type) and issubclass(c, Section) and
                c.__module__ == sections.__name__}
    assert set(CONTRACT.values()) == declared  # and the list above misses none
    parsed = {CONTRACT[name] for name in WorkerSpec.__dataclass_fields__ if name in CONTRACT}
    assert parsed == {*SECTIONS.values(), sections.FineTuningSection}  # the rank parses with them, nothing else


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_the_driver_validates_each_section_with_a_subclass_that_declares_none_of_its_fields_again(name):
    contract, driver = CONTRACT[name], _driver_class(PLACES[name])
    assert issubclass(driver, contract), f"{driver.__name__} does not build on {contract.__name__}"
    for field in contract.model_fields:
        where = _declaring(driver, field)
        if (PLACES[name][0], field) in NARROWED:
            assert driver.model_fields[field].default == contract.model_fields[field].default
            continue
        assert where == [contract], f"{PLACES[name]}.{field} is declared in {[c.__name__ for c in where]}"


def test_the_model_section_is_the_model_config_and_the_fine_tuning_fields_and_the_drivers_preset():
    own = {f for f in ModelSpec.model_fields if len(_declaring(ModelSpec, f)) == 1 and ModelSpec in
           _declaring(ModelSpec, f)}
    assert own == {"preset"}  # the only field the driver adds: expanded before validation, never read by a rank
    assert set(ModelSpec.model_fields) == {*ModelConfig.model_fields, *sections.FineTuningSection.model_fields,
                                           "preset"}


def test_a_rank_reads_the_defaults_the_contract_declares(tmp_path):
    """A job file that sets nothing but its data: every section a rank parses equals the contract class's own
    defaults (apart from what worker_dict derives), so a default changed there is the job's and the rank's."""
    job = JobSpec.from_dict({"data": {"path": str(tmp_path)}})
    spec = WorkerSpec.from_dict(job.worker_dict())
    derived = {"parallel": {"virtual_stages": 1, "pp_split": [job.model.n_layers]},
               "memory": {"recompute": "none"}, "train": {"compile": False}}  # unset: the CPU defaults
    for name, contract in SECTIONS.items():
        expected = contract(**{"path": str(tmp_path)} if name == "data" else {}).model_copy(update=derived.get(name))
        assert getattr(spec, name) == expected, name
    assert spec.finetune == sections.FineTuningSection()


@pytest.mark.parametrize("path", [("memory", "measure"), ("parallel", "cp"), ("train", "compile"),
                                  ("precision", "policy"), ("memory", "offload", "tier"), ("metrics", "comm_bytes"),
                                  ("model", "lora"), ("model", "d_model"), ("eval",)])
def test_an_old_style_partial_dict_is_refused_naming_the_missing_field(tmp_path, path):
    """The fields older hand-written harness dicts left out (and a whole section) are refused by name, not
    filled in with a default the controller never sent."""
    raw = JobSpec.from_dict({"data": {"path": str(tmp_path)}}).worker_dict()
    holder = raw
    for part in path[:-1]:
        holder = holder[part]
    del holder[path[-1]]
    what = "section" if len(path) == 1 else "field"
    with pytest.raises(KeyError, match=rf"worker spec {what} {'.'.join(path)} is missing; build the dict with "
                                       r"JobSpec.from_dict\(job\).worker_dict\(\)"):
        WorkerSpec.from_dict(raw)


def test_the_controllers_own_fields_reach_no_rank(tmp_path):
    """`metrics.port`, `fault_tolerance.heartbeat_timeout_s` and `model.preset` are in the dict (it is the job's),
    and a rank's sections hold only what it reads."""
    job = JobSpec.from_dict({"data": {"path": str(tmp_path)}, "metrics": {"port": 0, "timeline": True}})
    spec = WorkerSpec.from_dict(job.worker_dict())
    assert spec.metrics == sections.MetricsSection(timeline=True)
    assert not hasattr(spec.fault_tolerance, "heartbeat_timeout_s") and not hasattr(spec.model, "preset")
