"""`memory.recompute` and `train.compile` left unset: the CPU defaults on a CPU (every existing job file means what
it meant), and on a GPU the fast settings the planner's memory model picks (no recompute when it fits, selective
before full; compile where the job's settings allow it), said as `event=defaults_picked`. Ray-free: the planner's
figures for a 1B Llama on an 80 GB GPU, the device memory set around them."""

from __future__ import annotations

import pytest

from orchestrator.planning import fast_defaults
from orchestrator.spec import JobSpec
from tests.support.events import recorded_events

LLAMA_1B = {"model": {"preset": "llama-1b", "seq_len": 2048}, "parallel": {"device": "cuda"},
            "precision": {"dtype": "bf16"}, "train": {"global_batch_size": 8, "microbatches": 1}}


def _job(tmp_path, **sections) -> JobSpec:
    raw = {name: dict(fields) for name, fields in LLAMA_1B.items()}
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    return JobSpec.from_dict({**raw, "data": {"path": str(tmp_path)}})


def test_a_cpu_job_keeps_the_defaults_it_always_had(tmp_path):
    job = JobSpec.from_dict({"data": {"path": str(tmp_path)}, "parallel": {"device": "cpu"}})
    assert (job.memory.recompute, job.train.compile) == ("none", False)
    assert job.unset_fields == {"memory.recompute", "train.compile"}
    raw = job.to_dict()
    assert raw["memory"]["recompute"] is None and raw["train"]["compile"] is None  # still unset for a hosted run
    assert JobSpec.from_dict(raw).unset_fields == job.unset_fields
    worker = job.worker_dict()
    assert (worker["memory"]["recompute"], worker["train"]["compile"]) == ("none", False)
    pinned, picked = fast_defaults.pin_defaults(job)
    assert picked == {} and not pinned.unset_fields
    assert (pinned.memory.recompute, pinned.train.compile) == ("none", False)


def test_the_decision_takes_the_lightest_policy_that_fits():
    peaks = {"none": 100, "selective": 70, "full": 40}
    assert fast_defaults.pick_recompute(peaks.get, 120)[0] == "none"
    assert fast_defaults.pick_recompute(peaks.get, 80)[0] == "selective"
    policy, why = fast_defaults.pick_recompute(peaks.get, 50)
    assert policy == "full" and "none would not fit" in why and "selective would not fit" in why
    assert fast_defaults.pick_recompute(peaks.get, 10)[0] == "full"  # nothing fits: full, the fit warning follows
    assert fast_defaults.pick_recompute({"none": None, "selective": 70, "full": 40}.get, 120)[0] == "selective"


def _peaks(tmp_path) -> dict[str, int]:
    job = _job(tmp_path)
    return {p: fast_defaults.peak_bytes(fast_defaults.with_values(job, {"memory.recompute": p, "train.compile": True}))
            for p in fast_defaults.RECOMPUTE_ORDER}


@pytest.mark.parametrize("room, expected", [("plenty", "none"), ("tight", "selective"), ("tighter", "full")])
def test_on_a_gpu_the_planner_picks_no_recompute_when_it_fits_then_selective_then_full(room, expected, tmp_path):
    peaks = _peaks(tmp_path)
    assert peaks["none"] > peaks["selective"] > peaks["full"]
    between = {"plenty": 2 * peaks["none"], "tight": (peaks["none"] + peaks["selective"]) // 2,
               "tighter": (peaks["selective"] + peaks["full"]) // 2}[room]
    job = _job(tmp_path, parallel={"device_memory": int(between / 0.9)})  # memory.headroom: 0.1
    with recorded_events() as events:
        pinned, picked = fast_defaults.pin_defaults(job)
    assert (pinned.memory.recompute, pinned.train.compile) == (expected, True)
    assert not pinned.unset_fields and picked["memory.recompute"][0] == expected
    said = {fields["field"]: fields for name, fields in events if name == "defaults_picked"}
    assert said["memory.recompute"]["value"] == expected and "fits" in said["memory.recompute"]["why"]
    assert said["train.compile"]["value"] == "True"


def test_what_the_job_sets_is_kept_and_compile_is_not_picked_where_refused(tmp_path):
    job = _job(tmp_path, memory={"recompute": "full"}, train={"compile": False})
    assert fast_defaults.pin_defaults(job) == (job, {})
    zbv = _job(tmp_path, parallel={"pp": 2, "pp_schedule": "zbv"}, train={"microbatches": 4},
               model={"tie_embeddings": False})
    pinned, picked = fast_defaults.pin_defaults(zbv)
    assert pinned.train.compile is False and "parallel.pp_schedule" in picked["train.compile"][1]


def test_compile_is_not_picked_for_paths_compiled_on_cpu_only(tmp_path):
    """cp, document masks and MoE compile (the spec accepts them) but have not run compiled on a GPU: a GPU job that
    leaves compile unset runs them eager, and says why."""
    doc = _job(tmp_path, model={"attention_mask": "document"})
    pinned, picked = fast_defaults.pin_defaults(doc)
    assert pinned.train.compile is False and "checked on CPU only" in picked["train.compile"][1]
    assert fast_defaults.refusal(fast_defaults.with_values(doc, {"train.compile": True})) is None  # accepted if asked
