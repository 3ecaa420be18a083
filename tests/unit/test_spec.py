"""Job-file spec: defaults, loading, overrides and actionable error messages."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import SpecError
from orchestrator.spec import (
    JobSpec,
    apply_overrides,
    check_before_start,
    check_data_path,
    check_resources,
    load_spec,
    parse_override,
)
from orchestrator.spec.sections import dp_replicas_mirror
from tests.support.spec_errors import assert_actionable, spec_error

BASE: dict[str, Any] = {"data": {"path": "data/tiny"}}


def job(**sections: Any) -> dict[str, Any]:
    return {**BASE, **sections}


# ---------------------------------------------------------------- defaults and round trip


def test_defaults() -> None:
    spec = JobSpec.from_dict(BASE)
    assert spec.name == "raymesh-job"
    assert spec.resolved_run_dir() == Path("runs/raymesh-job")
    assert spec.model.ffn_dim == 4 * spec.model.d_model == 256
    assert spec.model.positions == "rotary"
    assert spec.data.seed == 0
    p = spec.parallel
    assert (p.dp, p.pp, p.tp, p.zero, p.pp_schedule, p.stages_per_rank) == (1, 1, 1, 0, "1f1b", 1)
    assert p.world_size == 1 and p.device == "auto" and p.sequence_parallel and p.cpus_per_rank == 1.0
    assert spec.optim.name == "adamw" and spec.optim.betas == (0.9, 0.95) and spec.optim.lr == 3e-3
    assert spec.precision.dtype == "fp32" and spec.precision.initial_loss_scale == 65536.0
    assert spec.memory.recompute == "none"
    t = spec.train
    assert (t.steps, t.global_batch_size, t.microbatches, t.seed, t.log_every) == (100, 16, 1, 0, 1)
    c = spec.checkpoint
    assert (c.every, c.dir, c.async_save, c.keep, c.memory_every) == (50, None, True, 3, None)
    assert c.snapshot_every(spec.parallel, spec.optim) == 10  # dp 1: nothing mirrors this rank
    dp2 = JobSpec.from_dict({**BASE, "parallel": {"dp": 2}})
    assert c.snapshot_every(dp2.parallel, dp2.optim) == 1  # zero-0 mirrors: free
    assert c.resolved_dir(spec.resolved_run_dir()) == Path("runs/raymesh-job/checkpoints")


@pytest.mark.parametrize(("parallel", "optim", "mirrors"), [
    ({"grad_compression": "bf16"}, {}, True),  # nothing held back: the ranks' state stays the same
    ({"grad_compression": "powersgd"}, {}, False),
    ({"grad_compression": "topk"}, {}, False),
    ({}, {"name": "onebit_adam", "warmup_steps": 10}, False),
    ({"pp": 2, "pp_schedule": "pipedream_2bw"}, {}, False),  # in-flight microbatches of each rank's own data
    ({"pp": 2, "pp_schedule": "1f1b"}, {}, True),
])
def test_data_parallel_ranks_that_keep_their_own_state_ship_replicas(parallel, optim, mirrors) -> None:
    """A rank's error feedback, or its asynchronous pipeline's microbatches in flight, are its own, so a peer's
    snapshot is not its replica: replicas ship, and the snapshot cadence is the shipped one's default."""
    spec = JobSpec.from_dict({**BASE, "parallel": {"dp": 2, **parallel}, "optim": optim, "train": {"microbatches": 2}})
    assert dp_replicas_mirror(spec.parallel, spec.optim) is mirrors
    assert spec.checkpoint.snapshot_every(spec.parallel, spec.optim) == (1 if mirrors else 10)


def test_explicit_dirs_and_d_ff() -> None:
    spec = JobSpec.from_dict(job(run_dir="/r", model={"d_ff": 96}, checkpoint={"dir": "/c"}))
    assert spec.resolved_run_dir() == Path("/r")
    assert spec.checkpoint.resolved_dir(spec.resolved_run_dir()) == Path("/c")
    assert spec.model.ffn_dim == 96


def test_a_url_run_dir_is_staged_locally_and_keeps_its_checkpoints_in_the_bucket() -> None:
    from workers.storage import staging_dir

    spec = JobSpec.from_dict(job(run_dir="s3://bkt/runs/a"))
    assert spec.run_dir_url() == "s3://bkt/runs/a" and spec.resolved_run_dir() == staging_dir("s3://bkt/runs/a")
    assert spec.resolved_run_dir().name.startswith("a-") and spec.resolved_run_dir().is_absolute()
    assert str(spec.checkpoint_dir()) == "s3://bkt/runs/a/checkpoints"  # written by DCP there, never staged
    assert staging_dir("s3://bkt/runs/b/a") != spec.resolved_run_dir()  # one per URL, not per last name
    local = JobSpec.from_dict(job(run_dir="file:///r"))
    assert local.run_dir_url() is None and local.resolved_run_dir() == Path("/r")
    assert local.checkpoint_dir() == Path("/r/checkpoints")


@pytest.mark.parametrize(
    ("schedule", "stages"),
    [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)],
)
def test_stages_per_rank_default(schedule: str, stages: int) -> None:
    raw = job(model={"n_layers": 8}, parallel={"pp": 2, "pp_schedule": schedule}, train={"microbatches": 4})
    spec = JobSpec.from_dict(raw)
    assert spec.parallel.stages_per_rank == stages
    assert spec.parallel.world_size == 2


def test_async_alias_and_round_trip() -> None:
    spec = JobSpec.from_dict(job(checkpoint={"async": True, "every": 5}, optim={"betas": [0.8, 0.9]}))
    assert spec.checkpoint.async_save is True
    assert JobSpec.from_dict(job(checkpoint={"async_save": True})).checkpoint.async_save is True
    d = spec.to_dict()
    assert d["checkpoint"]["async"] is True and "async_save" not in d["checkpoint"]
    assert json.loads(json.dumps(d)) == d
    assert JobSpec.from_dict(d) == spec


def test_empty_section_means_defaults() -> None:
    assert JobSpec.from_dict(job(checkpoint=None)).checkpoint.keep == 3


def test_allowed_combinations() -> None:
    JobSpec.from_dict(job(parallel={"zero": 3, "tp": 2, "dp": 2}))
    JobSpec.from_dict(job(parallel={"zero": 1, "pp": 2}, train={"microbatches": 2}))
    JobSpec.from_dict(job(precision={"dtype": "fp16"}, parallel={"device": "cpu"}))


# ---------------------------------------------------------------- unknown keys and type errors


def test_unknown_field_suggests_and_lists() -> None:
    err = spec_error(job(model={"n_head": 8}))
    msg = assert_actionable(err, "model.n_head", None, "did you mean `n_heads`?", "valid fields:", "d_model")
    assert msg.startswith("job file field `model.n_head`: unknown field; fix: did you mean `n_heads`?")


def test_unknown_top_level_section_lists_sections() -> None:
    err = spec_error(job(modle={}))
    assert_actionable(err, "modle", None, "did you mean `model`?", "parallel", "checkpoint")


def test_misplaced_field_points_to_its_section() -> None:
    err = spec_error(job(steps=10))
    assert_actionable(err, "steps", None, "`train.steps`")


def test_unknown_field_reported_before_others_with_count() -> None:
    err = spec_error(job(model={"n_head": 8, "d_model": "x"}, train={"steps": 0}))
    assert err.field == "model.n_head"
    assert "2 more problems" in str(err)


@pytest.mark.parametrize(
    ("raw", "field", "value", "fix_part"),
    [
        (job(model={"d_model": "wide"}), "model.d_model", "wide", "a whole number; the default is 64"),
        (job(model={"positions": "rotry"}), "model.positions", "rotry", "did you mean rotary?"),
        (job(parallel={"zero": 4}), "parallel.zero", 4, "a number <= 3"),
        (job(parallel={"pp_schedule": "zb"}), "parallel.pp_schedule", "zb", "interleaved_zero_bubble"),
        (job(parallel={"dp": 0}), "parallel.dp", 0, ">= 1"),
        (job(train={"steps": 0}), "train.steps", 0, "> 0"),
        (job(optim={"lr": -1.0}), "optim.lr", -1.0, "> 0"),
        (job(optim={"name": "lion"}), "optim.name", "lion", "adamw"),
        (job(optim={"betas": [0.9, 1.5]}), "optim.betas[1]", 1.5, "< 1"),
        (job(checkpoint={"keep": 0}), "checkpoint.keep", 0, ">= 1"),
        (job(parallel={"sequence_parallel": "maybe"}), "parallel.sequence_parallel", "maybe", "true or false"),
        (job(name="my job"), "name", "my job", "letters, digits"),
        (job(name=".."), "name", "..", "a letter or digit"),  # runs/.. is the current directory
        (job(name="."), "name", ".", "a letter or digit"),
        (job(model=5), "model", 5, "key: value"),
    ],
)
def test_type_errors_become_spec_errors(raw: dict[str, Any], field: str, value: Any, fix_part: str) -> None:
    assert_actionable(spec_error(raw), field, value, fix_part)


def test_short_betas() -> None:
    assert_actionable(spec_error(job(optim={"betas": [0.9]})), "optim.betas", [0.9], "a list of 2 items", "[0.9, 0.95]")


@pytest.mark.parametrize(("raw", "field"), [({}, "data"), ({"data": {}}, "data.path")])
def test_missing_data_path(raw: dict[str, Any], field: str) -> None:
    assert_actionable(spec_error(raw), field, None, "raymesh prepare-data")


def test_no_pydantic_traceback_chained() -> None:
    err = spec_error(job(model={"d_model": "x"}))
    assert err.__context__ is None and err.__cause__ is None


# ---------------------------------------------------------------- cross-field rules


def test_heads_must_divide_d_model() -> None:
    err = spec_error(job(model={"d_model": 60, "n_heads": 8}))
    assert_actionable(err, "model.n_heads", 8, "[1, 2, 3, 4, 5, 6, 10, 12")


def test_rotary_needs_even_head_dim() -> None:
    err = spec_error(job(model={"d_model": 36, "n_heads": 4}))
    assert_actionable(err, "model.n_heads", 4, "[1, 2, 3, 6, 9, 18]", "positions: learned")
    JobSpec.from_dict(job(model={"d_model": 36, "n_heads": 4, "positions": "learned"}))


def test_layers_must_split_into_stages() -> None:
    err = spec_error(job(model={"n_layers": 6}, parallel={"pp": 4}, train={"microbatches": 4}))
    assert_actionable(err, "model.n_layers", 6, "multiple of 4", "pick parallel.pp from [1, 2, 3, 6]")


def test_layers_split_counts_virtual_stages() -> None:
    raw = job(model={"n_layers": 6}, parallel={"pp": 2, "pp_schedule": "interleaved_1f1b"}, train={"microbatches": 2})
    err = spec_error(raw)
    assert_actionable(err, "model.n_layers", 6, "multiple of 4", "[1, 3]", "pp_schedule: 1f1b")
    assert "2 * 2 = 4 pipeline stages" in str(err)


@pytest.mark.parametrize(
    ("parallel", "fix_part"),
    [
        ({"pp_schedule": "gpipe", "virtual_stages": 2}, "remove virtual_stages"),
        ({"pp_schedule": "interleaved_1f1b", "virtual_stages": 1}, "2 or more"),
        ({"pp_schedule": "zbv", "virtual_stages": 3}, "virtual_stages: 2"),
        ({"pp_schedule": "dualpipev", "virtual_stages": 4}, "virtual_stages: 2"),
    ],
)
def test_virtual_stages_per_schedule(parallel: dict[str, Any], fix_part: str) -> None:
    err = spec_error(job(model={"n_layers": 24}, parallel=parallel))
    assert_actionable(err, "parallel.virtual_stages", parallel["virtual_stages"], fix_part)


def test_tp_must_divide_model_dims() -> None:
    err = spec_error(job(parallel={"tp": 3}))
    msg = assert_actionable(err, "parallel.tp", 3, "pick parallel.tp from [1, 2, 4]")
    assert "model.n_heads=4" in msg and "model.vocab_size" not in msg  # the vocabulary is padded instead


def test_tp_vocab_and_sequence_parallel() -> None:
    raw = job(model={"vocab_size": 250, "seq_len": 100, "d_model": 128, "n_heads": 8}, parallel={"tp": 8})
    err = spec_error(raw)
    msg = assert_actionable(err, "parallel.tp", 8, "[1, 2, 4]", "sequence_parallel: false")
    assert "model.vocab_size" not in msg and "model.seq_len" in msg


def test_the_vocabulary_is_padded_to_a_multiple_of_tp_for_the_workers() -> None:
    spec = JobSpec.from_dict(job(model={"vocab_size": 250, "d_model": 128, "n_heads": 8}, parallel={"tp": 8}))
    assert (spec.model.vocab_size, spec.padded_vocab_size, spec.worker_dict()["model"]["vocab_size"]) == (250, 256, 256)
    assert JobSpec.from_dict(job(model={"vocab_size": 250})).worker_dict()["model"]["vocab_size"] == 250


def test_global_batch_divisible_by_dp() -> None:
    err = spec_error(job(parallel={"dp": 3}))
    assert_actionable(err, "train.global_batch_size", 16, "[15, 18]", "pick parallel.dp from [1, 2, 4, 8, 16]")


def test_microbatches_divide_per_rank_batch() -> None:
    err = spec_error(job(parallel={"dp": 2}, train={"microbatches": 3}))
    msg = assert_actionable(err, "train.microbatches", 3, "pick train.microbatches from [1, 2, 4, 8]")
    assert "16/2 = 8" in msg


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_needs_microbatches_at_least_pp(schedule: str) -> None:
    err = spec_error(job(parallel={"pp": 4, "pp_schedule": schedule}, train={"microbatches": 2}))
    msg = assert_actionable(err, "train.microbatches", 2, "[4, 8, 16]")
    assert "microbatches >= pp" in msg


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "interleaved_zero_bubble"])
def test_interleaved_needs_multiple_of_pp(schedule: str) -> None:
    raw = job(
        model={"n_layers": 12},
        parallel={"pp": 3, "pp_schedule": schedule},
        train={"global_batch_size": 24, "microbatches": 4},
    )
    msg = assert_actionable(spec_error(raw), "train.microbatches", 4, "[3, 6, 12, 24]")
    assert "multiple of parallel.pp=3" in msg


def test_pipeline_batch_too_small_suggests_bigger_batch() -> None:
    raw = job(parallel={"pp": 4, "dp": 2}, train={"global_batch_size": 4, "microbatches": 2})
    assert_actionable(spec_error(raw), "train.microbatches", 2, "global_batch_size to a multiple of dp*pp = 8")


PS = {"dp": 2, "dp_sync": "ps"}


@pytest.mark.parametrize(("raw", "field", "value", "fix_part"), [
    (job(parameter_server={"consistency": "asp"}), "parameter_server.consistency", "asp", "set parallel.dp_sync: ps"),
    (job(parameter_server={"shards": 8}), "parameter_server.shards", 8, "remove the parameter_server section"),
    (job(parallel=PS, parameter_server={"staleness": 5}), "parameter_server.staleness", 5, "consistency: ssp"),
    (job(parallel=PS, parameter_server={"consistency": "asp", "staleness": 0}), "parameter_server.staleness", 0,
     "consistency: ssp"),
])
def test_parameter_server_settings_nothing_reads_are_refused(raw, field, value, fix_part) -> None:
    """Without shards every `parameter_server:` setting is ignored, and `staleness` is ssp's bound only."""
    assert_actionable(spec_error(raw), field, value, fix_part)
    JobSpec.from_dict(job(parallel=PS, parameter_server={"consistency": "ssp", "staleness": 5}))


# ---------------------------------------------------------------- overrides


def test_parse_override_types() -> None:
    assert parse_override("parallel.dp=4") == (("parallel", "dp"), 4)
    assert parse_override("optim.lr=0.1") == (("optim", "lr"), 0.1)
    assert parse_override("checkpoint.async=true") == (("checkpoint", "async"), True)
    assert parse_override("optim.betas=[0.9, 0.99]") == (("optim", "betas"), [0.9, 0.99])
    assert parse_override("name=a=b") == (("name",), "a=b")


def test_override_without_equals() -> None:
    with pytest.raises(SpecError) as info:
        parse_override("parallel.dp4")
    assert_actionable(info.value, None, "parallel.dp4", "key.path=value")
    assert str(info.value).startswith("override:")


def test_override_with_empty_key() -> None:
    with pytest.raises(SpecError) as info:
        parse_override("parallel..dp=4")
    assert_actionable(info.value, None, "parallel..dp=4", "train.steps=10")


def test_override_creates_nested_dicts_without_mutating() -> None:
    raw = {"data": {"path": "d"}}
    out = apply_overrides(raw, ["parallel.dp=2", "train.steps=5"])
    assert out["parallel"] == {"dp": 2} and out["train"] == {"steps": 5}
    assert raw == {"data": {"path": "d"}}


def test_override_into_scalar_field() -> None:
    with pytest.raises(SpecError) as info:
        apply_overrides(BASE, ["data.path.x=1"])
    assert_actionable(info.value, "data.path", "data/tiny", "override `data.path` itself")


def test_with_overrides_returns_validated_copy() -> None:
    spec = JobSpec.from_dict(BASE)
    new = spec.with_overrides(["parallel.dp=2", "checkpoint.async=true", "optim.betas=[0.8, 0.9]"])
    assert new.parallel.dp == 2 and new.checkpoint.async_save and new.optim.betas == (0.8, 0.9)
    assert spec.parallel.dp == 1


def test_unknown_override_key_same_message() -> None:
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(BASE).with_overrides(["model.n_head=8"])
    assert_actionable(info.value, "model.n_head", None, "did you mean `n_heads`?")


def test_override_violating_cross_field_rule() -> None:
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(BASE).with_overrides(["parallel.tp=3"])
    assert info.value.field == "parallel.tp"


# ---------------------------------------------------------------- loading files


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_load_resolves_paths_against_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sub = tmp_path / "jobs"
    sub.mkdir()
    f = write(sub / "job.yaml", "run_dir: out\ndata:\n  path: data/tiny\ncheckpoint:\n  dir: ckpt\n  async: true\n")
    monkeypatch.chdir(tmp_path)
    spec = load_spec(Path("jobs/job.yaml"))
    assert spec.data.path == str(tmp_path / "data/tiny")
    assert spec.run_dir == str(tmp_path / "out")
    assert spec.checkpoint.dir == str(tmp_path / "ckpt")
    assert spec.checkpoint.async_save is True
    absolute = load_spec(f, ["data.path=/abs/data"])
    assert absolute.data.path == "/abs/data"


def test_load_applies_overrides(tmp_path: Path) -> None:
    f = write(tmp_path / "job.yaml", "data:\n  path: /d\nparallel:\n  dp: 2\n")
    spec = load_spec(str(f), ["parallel.dp=4", "train.steps=7"])
    assert spec.parallel.dp == 4 and spec.train.steps == 7


def test_load_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(missing)
    msg = assert_actionable(info.value, None, str(missing), "current directory")
    assert "does not exist" in msg


def test_load_yaml_error_has_line(tmp_path: Path) -> None:
    f = write(tmp_path / "bad.yaml", "data:\n  path: /d\nmodel:\n  d_model: 64\n   n_heads: 4\n")
    with pytest.raises(SpecError) as info:
        load_spec(f)
    msg = assert_actionable(info.value, None, str(f), "line 5")
    assert "line 5" in msg and info.value.__suppress_context__  # no YAML traceback shown


def test_load_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path / "list.yaml", "- a\n- b\n"))
    assert_actionable(info.value, None, str(tmp_path / "list.yaml"), "section:")


def test_load_empty_file_asks_for_data(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path / "empty.yaml", ""))
    assert info.value.field == "data"


def test_load_reports_unknown_key_from_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path / "job.yaml", "data:\n  path: /d\nparalel:\n  dp: 2\n"))
    assert_actionable(info.value, "paralel", None, "did you mean `parallel`?")


# ---------------------------------------------------------------- runtime checks


def test_check_data_path(tmp_path: Path) -> None:
    spec = JobSpec.from_dict({"data": {"path": str(tmp_path)}})
    with pytest.raises(SpecError) as info:
        check_data_path(spec)
    assert_actionable(info.value, "data.path", str(tmp_path), f"raymesh prepare-data --out {tmp_path}")
    (tmp_path / "manifest.json").write_text("{}")  # not one prepare-data wrote: no token count
    with pytest.raises(SpecError, match="manifest.json that is not readable"):
        check_data_path(spec)
    (tmp_path / "manifest.json").write_text('{"total_tokens": 100000}')
    check_data_path(spec)


def _unreadable_to_this_user(path: Path, monkeypatch) -> None:
    """Make `path` unreadable to this process: chmod 000, and where that does not stop reads (root), os.access, the
    call the check asks, answering for it as it would for another user."""
    path.chmod(0)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != path and real(p, mode, **kw))


@pytest.mark.parametrize("field", ["data.path", "eval.path"])
@pytest.mark.parametrize("which", ["shard-00001.parquet", "manifest.json"])
def test_prepared_data_this_user_cannot_read_is_refused_naming_the_file_and_the_fix(field, which, tmp_path,
                                                                                  monkeypatch):
    """A shard (or manifest) with no read permission passed the pre-start checks, and the first rank to load the
    data failed after placement with a bare PermissionError."""
    from workers.data import prepare_data

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("x" * 400)
    (tmp_path / "src" / "b.txt").write_text("y" * 400)
    prepare_data([tmp_path / "src"], tmp_path / "data", shard_tokens=300, heldout=0.5)  # b.txt: data/heldout
    folder = {"data.path": tmp_path / "data", "eval.path": tmp_path / "data" / "heldout"}
    spec = JobSpec.from_dict({"data": {"path": str(folder["data.path"])}, "model": {"seq_len": 8},
                              "train": {"global_batch_size": 2}, "run_dir": str(tmp_path / "runs"),
                              "eval": {"path": str(folder["eval.path"]), "every": 1, "batches": 1}})
    check_before_start(spec)
    target = folder[field] / which
    _unreadable_to_this_user(target, monkeypatch)
    with pytest.raises(SpecError) as info:
        check_before_start(spec)
    msg = assert_actionable(info.value, field, str(target.parent), f"chmod -R a+rX {target.parent}")
    assert f"holds {target}, which cannot be read by this user (permission denied)" in msg


def test_a_shard_missing_from_prepared_data_is_refused_before_start(tmp_path):
    from workers.data import prepare_data

    (tmp_path / "a.txt").write_text("x" * 400)
    prepare_data([tmp_path / "a.txt"], tmp_path / "data", shard_tokens=300)
    (tmp_path / "data" / "shard-00001.parquet").unlink()
    spec = JobSpec.from_dict({"data": {"path": str(tmp_path / "data")}, "model": {"seq_len": 8},
                              "train": {"global_batch_size": 2}})
    with pytest.raises(SpecError) as info:
        check_data_path(spec)
    msg = assert_actionable(info.value, "data.path", str(tmp_path / "data"), "raymesh prepare-data --out")
    assert f"lists shard {tmp_path / 'data' / 'shard-00001.parquet'} in its manifest.json, which is missing" in msg


def test_a_model_vocabulary_smaller_than_the_data_is_refused(tmp_path: Path) -> None:
    tok = {"kind": "bpe", "path": str(tmp_path / "tokenizer.json"), "vocab_size": 1000, "eos_id": 0}
    (tmp_path / "manifest.json").write_text(json.dumps({"vocab_size": 1000, "tokenizer": tok, "total_tokens": 10**6}))
    small = JobSpec.from_dict({"data": {"path": str(tmp_path)}, "parallel": {"tp": 2}})
    with pytest.raises(SpecError) as info:
        check_data_path(small)
    msg = assert_actionable(info.value, "model.vocab_size", 256, "set model.vocab_size: 1000")
    assert "1000 ids, tokenizer bpe" in msg
    check_data_path(JobSpec.from_dict({"data": {"path": str(tmp_path)}, "model": {"vocab_size": 1000}}))


def test_check_resources_cpu() -> None:
    spec = JobSpec.from_dict(job(parallel={"dp": 2, "tp": 2}))
    check_resources(spec, available_cpus=4, available_gpus=0, device="cpu")
    with pytest.raises(SpecError) as info:
        check_resources(spec, available_cpus=3, available_gpus=0, device="cpu")
    msg = assert_actionable(info.value, "parallel.dp*pp*tp", 4, "dp*pp*tp <= 3", "--num-cpus", "add nodes")
    assert "needs 4 CPUs" in msg and "the Ray cluster has 3 in total" in msg


def test_check_resources_gpu() -> None:
    spec = JobSpec.from_dict(job(parallel={"dp": 4}))
    check_resources(spec, available_cpus=8, available_gpus=4, device="cuda")
    with pytest.raises(SpecError) as info:
        check_resources(spec, available_cpus=8, available_gpus=2, device="auto")
    msg = assert_actionable(info.value, "parallel.dp*pp*tp", 4, "dp*pp*tp <= 2", "parallel.device: cpu")
    assert "needs 4 GPUs" in msg


def test_check_resources_auto_without_gpus_uses_cpus() -> None:
    check_resources(JobSpec.from_dict(job(parallel={"dp": 2})), available_cpus=2, available_gpus=0, device="auto")


def test_cwd_unchanged_by_loading(tmp_path: Path) -> None:
    before = os.getcwd()
    load_spec(write(tmp_path / "job.yaml", "data:\n  path: d\n"))
    assert os.getcwd() == before


def test_dualpipev_needs_a_microbatch_per_stage() -> None:
    raw = job(model={"n_layers": 8}, parallel={"pp": 2, "pp_schedule": "dualpipev"}, train={"microbatches": 2})
    expected = r"train\.microbatches.*value 2.*microbatches >= 2\*pp.*fix: pick train\.microbatches from \[4"
    with pytest.raises(SpecError, match=expected):
        JobSpec.from_dict(raw)


def test_zero1_is_accepted_on_every_layout_and_with_an_offloaded_optimizer() -> None:
    """The distributed optimizer (workers/parallel/distributed_optimizer.py) takes tp shards and pipeline stages."""
    JobSpec.from_dict(job(parallel={"dp": 2, "pp": 2, "tp": 2, "zero": 1}, train={"microbatches": 2}))
    JobSpec.from_dict(job(parallel={"dp": 2, "zero": 1}, memory={"offload": {"optimizer": True}}))
    JobSpec.from_dict(job(parallel={"dp": 2, "zero": 1}, optim={"name": "paged_adamw"}))


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv", "dualpipev"])
def test_zero3_with_split_backward_schedules_is_refused(schedule: str) -> None:
    raw = job(model={"n_layers": 8}, parallel={"dp": 2, "pp": 2, "zero": 3, "pp_schedule": schedule},
              train={"microbatches": 4})
    with pytest.raises(SpecError, match=rf"parallel\.zero.*value 3.*{schedule}.*fix: use zero: 2"):
        JobSpec.from_dict(raw)
