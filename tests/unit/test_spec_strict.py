"""Strict job files: the YAML loader, strict types, bounds from reality and the pre-start filesystem checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from orchestrator.checkpoints import checksums
from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec, check_before_start, load_spec, parse_override
from orchestrator.spec.fields import NAME_MAX, PATH_MAX, _divisors
from orchestrator.spec.lora import check_base_checkpoint, export_merged_weights
from tests.support.spec_errors import assert_actionable


def load_text(tmp_path: Path, text: str | bytes, *sets: str) -> JobSpec:
    job = tmp_path / "job.yaml"
    job.write_bytes(text if isinstance(text, bytes) else text.encode())
    return load_spec(job, sets)


def refused(tmp_path: Path, text: str | bytes, *sets: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_text(tmp_path, text, *sets)
    assert "fix: " in str(info.value)
    return info.value


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A prepared-data stand-in: only the manifest's token count matters to the checks."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"total_tokens": 10_000}))
    return tmp_path / "data"


# ---------------------------------------------------------------- the loader


def test_a_duplicate_key_names_the_key_path_and_both_lines(tmp_path):
    err = refused(tmp_path, "data:\n  path: d\noptim:\n  lr: 0.1\n  name: sgd\n  lr: 0.2\n")
    assert err.field == "optim.lr" and "lines 4 and 6" in str(err) and "keep one `lr:`" in err.fix


def test_a_duplicate_section_is_refused(tmp_path):
    err = refused(tmp_path, "data:\n  path: d\ntrain: {steps: 3}\ntrain:\n  steps: 4\n")
    assert err.field == "train" and "lines 3 and 4" in str(err)


def test_a_duplicate_key_in_an_override_value_is_refused():
    with pytest.raises(SpecError) as info:
        parse_override("optim={lr: 1, lr: 2}")
    assert info.value.field == "optim.lr" and "twice in override `optim`" in str(info.value)


def test_bytes_that_are_not_utf8_name_the_file_offset_and_line(tmp_path):
    err = refused(tmp_path, b"data:\n  path: d\nname: caf\xe9\n")
    assert str(tmp_path / "job.yaml") in str(err) and "byte 25 (line 3)" in str(err)
    err = refused(tmp_path, "data: {path: d}\n".encode("utf-16"))
    assert "byte 0 (line 1)" in str(err)


def test_an_override_holding_bytes_that_are_not_utf8_names_the_field(tmp_path):
    err = refused(tmp_path, "data: {path: d}\n", "name=caf\udce9")  # what argv holds for the byte 0xe9
    assert err.field == "name" and "not UTF-8" in str(err) and "override `name`" in str(err)


def test_exponent_floats_are_numbers_as_in_yaml_1_2(tmp_path):
    spec = load_text(tmp_path, "data: {path: d}\noptim: {lr: 1e-3, weight_decay: 2E-2}\n", "optim.lr=5e-4")
    assert spec.optim.lr == 5e-4 and spec.optim.weight_decay == 0.02


@pytest.mark.parametrize("text, sets, field, value, words", [
    ("checkpoint: {every: 0050}\n", (), "checkpoint.every", "0050", "octal number 40; fix: write 50"),
    ("train: {seed: 0_17}\n", (), "train.seed", "0_17", "octal number 15"),
    ("fault_tolerance: {heartbeat_timeout_s: 2:00}\n", (), "fault_tolerance.heartbeat_timeout_s", "2:00",
     "base 60 number 120"),
    ("", ("train.steps=010",), "train.steps", "010", "octal number 8; fix: write 10"),
])
def test_numbers_yaml_1_1_reads_as_octal_or_base_60_are_refused(tmp_path, text, sets, field, value, words):
    """PyYAML would silently read `0050` as 40 and `2:00` as 120; YAML 1.2 and a reader of the file would not."""
    err = refused(tmp_path, "data: {path: d}\n" + text, *sets)
    assert err.field == field and err.value == value and words in str(err), str(err)


def test_zero_quoted_and_prefixed_numbers_still_load(tmp_path):
    spec = load_text(tmp_path, "data: {path: d}\ntrain: {seed: 00, steps: 0x10}\nname: '010'\n")
    assert (spec.train.seed, spec.train.steps, spec.name) == (0, 16, "010")


# ---------------------------------------------------------------- strict types


@pytest.mark.parametrize("section, key, value, words", [
    ("train", "steps", True, "true/false are not numbers"),
    ("parallel", "zero", True, "whole number"),
    ("model", "d_model", "64", "written without quotes"),
    ("train", "steps", 2.5, "whole number"),
    ("optim", "lr", float("inf"), "finite number"),
    ("optim", "lr", float("nan"), "finite number"),
    ("optim", "betas", [float("nan"), 0.9], "finite number"),
    ("optim", "lr", True, "true/false are not numbers"),
    ("parallel", "sequence_parallel", 1, "true or false"),
    ("fault_tolerance", "warm_spares", "yes", "true or false"),
    ("fault_tolerance", "warm_spares", float("nan"), "true or false"),
    ("fault_tolerance", "heartbeat_timeout_s", 1e300, "<="),
    ("train", "seed", -1, ">= 0"),
    ("train", "steps", 2**64, "64 bits"),
    ("model", "n_layers", 10**7, "at most 10,000"),
])
def test_strict_types_name_the_field(section, key, value, words):
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"data": {"path": "d"}, section: {key: value}})
    assert info.value.field.startswith(f"{section}.{key}") and words in str(info.value), str(info.value)


def test_a_tuple_field_still_takes_a_yaml_list():
    assert JobSpec.from_dict({"data": {"path": "d"}, "optim": {"betas": [0.8, 0.9]}}).optim.betas == (0.8, 0.9)


@pytest.mark.parametrize("path, words", [
    ("a\x00b", "NUL byte"),
    ("/tmp/" + "x" * (NAME_MAX + 1), f"NAME_MAX={NAME_MAX}"),
    ("/tmp/" + "x/" * PATH_MAX, f"PATH_MAX={PATH_MAX}"),
])
def test_paths_the_os_cannot_create_are_refused(path, words):
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"data": {"path": "d"}, "checkpoint": {"dir": path}})
    assert info.value.field == "checkpoint.dir" and words in str(info.value)


def test_a_name_longer_than_a_file_name_is_refused():
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"data": {"path": "d"}, "name": "n" * NAME_MAX})
    assert info.value.field == "name"


def test_divisor_hints_stay_fast_for_huge_values():
    assert _divisors(12) == [1, 2, 3, 4, 6, 12]
    assert _divisors(2**62)[:3] == [1, 2, 4]  # would take forever by trial division up to n
    with pytest.raises(SpecError, match="train.global_batch_size"):
        JobSpec.from_dict({"data": {"path": "d"}, "parallel": {"dp": 3}, "train": {"global_batch_size": 2**62}})


def test_ps_shards_refuse_an_optimizer_they_do_not_have():
    from typing import get_args

    from orchestrator.spec import ParameterServerSpec
    from parameter_server.optimizers import _CLASSES

    declared = get_args(get_args(ParameterServerSpec.model_fields["optimizer"].annotation)[0])
    assert set(declared) == set(_CLASSES)  # the spec's list is the shards' table
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"data": {"path": "d"}, "parallel": {"dp_sync": "ps"}, "optim": {"name": "sm3"}})
    assert info.value.field == "optim.name" and "parameter_server.optimizer" in info.value.fix


# ---------------------------------------------------------------- before any actor starts


def _spec(data_dir: Path, **sections) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": str(data_dir)}, "run_dir": str(data_dir.parent / "run"), **sections})


def test_the_valid_job_passes(data_dir):
    check_before_start(_spec(data_dir, metrics={"port": 0}))


def test_seq_len_must_leave_one_batch_of_distinct_windows(data_dir):
    spec = _spec(data_dir, model={"seq_len": 1024}, train={"global_batch_size": 16})
    with pytest.raises(SpecError) as info:
        check_before_start(spec)
    msg = str(info.value)
    assert info.value.field == "model.seq_len" and "16,385 tokens" in msg and "holds 10,000" in msg
    assert "set model.seq_len to at most 624" in msg


def test_data_must_be_prepared(tmp_path, data_dir):
    (data_dir / "manifest.json").write_text("not json")
    with pytest.raises(SpecError, match="data.path.*not readable"):
        check_before_start(_spec(data_dir))
    with pytest.raises(SpecError, match="data.path.*prepare-data"):
        check_before_start(_spec(tmp_path / "missing"))
    check_before_start(_spec(tmp_path / "missing"), data_required=False)  # plan: the data may be elsewhere


def test_output_paths_must_be_writable_directories(tmp_path, data_dir):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for sections, field in [({"run_dir": str(a_file)}, "run_dir"),
                            ({"checkpoint": {"dir": str(a_file / "sub")}}, "checkpoint.dir"),
                            ({"memory": {"offload": {"optimizer": True, "tier": "nvme", "path": str(a_file)}}},
                             "memory.offload.path")]:
        with pytest.raises(SpecError) as info:
            check_before_start(JobSpec.from_dict({"data": {"path": str(data_dir)}, **sections}))
        assert info.value.field == field


@pytest.mark.parametrize("section, extra", [("control", {}), ("parameter_server", {"dp": 2, "dp_sync": "ps"})])
def test_tls_files_must_be_readable_before_any_actor_starts(tmp_path, data_dir, section, extra):
    """The controller reads the control pair after Ray is up, the shards' pair after the ranks started."""
    cert = tmp_path / "cert.pem"
    cert.write_text("PEM")
    for key_path, why in ((tmp_path / "missing.pem", "is not a readable file"), (tmp_path, "is a directory")):
        spec = _spec(data_dir, parallel=extra, **{section: {"tls_cert": str(cert), "tls_key": str(key_path)}})
        with pytest.raises(SpecError) as info:
            check_before_start(spec, data_required=False)
        assert why in assert_actionable(info.value, f"{section}.tls_key", str(key_path), "readable PEM file")
    check_before_start(_spec(data_dir, parallel=extra, **{section: {"tls_cert": str(cert), "tls_key": str(cert)}}))


def test_metrics_file_sd_never_overwrites_a_file_raymesh_did_not_write(tmp_path, data_dir):
    theirs = tmp_path / "prometheus.yml"
    theirs.write_text("scrape_configs: []\n")
    with pytest.raises(SpecError) as info:
        check_before_start(_spec(data_dir, metrics={"port": 0, "file_sd": str(theirs)}))
    assert info.value.field == "metrics.file_sd" and "did not write" in str(info.value)
    ours = tmp_path / "targets.json"  # what observability.prometheus writes, and writes on close
    for content in ([{"targets": ["h:1"], "labels": {"raymesh_job": "j"}}], []):
        ours.write_text(json.dumps(content))
        check_before_start(_spec(data_dir, metrics={"port": 0, "file_sd": str(ours)}))


def test_checkpoint_dir_never_overwrites_files_raymesh_did_not_write(tmp_path, data_dir):
    run = data_dir.parent / "run"
    ours = _dcp_dir(run / "checkpoints" / "step-00000005")  # a raymesh save: passes
    check_before_start(_spec(data_dir))
    (ours / "notes.txt").write_text("mine")
    with pytest.raises(SpecError) as info:
        check_before_start(_spec(data_dir))
    assert info.value.field == "checkpoint.dir" and "notes.txt, which raymesh did not write" in str(info.value)
    (ours / "notes.txt").unlink()
    (run / "checkpoints" / "step-00000010").write_text("a file where a save would go")
    with pytest.raises(SpecError, match="step-00000010, which raymesh did not write"):
        check_before_start(_spec(data_dir))


def _dcp_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"meta")
    (path / "__0_0.distcp").write_bytes(b"weights" * 100)
    checksums.write_manifest(path)
    return path


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))


def _lora(tmp_path: Path, base: Path | None = None) -> JobSpec:
    lora = {"base_checkpoint": str(base)} if base else {}
    return JobSpec.from_dict({"data": {"path": "d"}, "run_dir": str(tmp_path / "run"),
                              "model": {"d_model": 32, "n_heads": 4, "n_layers": 2, "lora": lora}})


def test_a_corrupt_dcp_base_checkpoint_is_refused_naming_the_file(tmp_path):
    base = _dcp_dir(tmp_path / "step-00000004")
    check_base_checkpoint(_lora(tmp_path, base))
    _corrupt(base / "__0_0.distcp")
    with pytest.raises(SpecError) as info:
        check_base_checkpoint(_lora(tmp_path, base))
    assert info.value.field == "model.lora.base_checkpoint" and "__0_0.distcp fails its CRC-32" in str(info.value)


def test_a_corrupt_pt_base_checkpoint_is_refused_by_its_sidecar_manifest(tmp_path):
    pt = tmp_path / "merged.pt"
    torch.save({"w": torch.arange(100.0)}, pt)
    checksums.write_file_manifest(pt)
    check_base_checkpoint(_lora(tmp_path, pt))
    _corrupt(pt)
    with pytest.raises(SpecError, match="merged.pt fails its CRC-32"):
        check_base_checkpoint(_lora(tmp_path, pt))
    os.remove(checksums.sidecar(pt))  # a .pt raymesh did not write: only loading it can judge it
    check_base_checkpoint(_lora(tmp_path, pt))


def test_export_merged_refuses_a_corrupt_checkpoint_before_merging(tmp_path):
    step = _dcp_dir(tmp_path / "run" / "checkpoints" / "step-00000002")
    _corrupt(step / ".metadata")
    with pytest.raises(SpecError) as info:
        export_merged_weights(_lora(tmp_path), None, str(tmp_path / "out.pt"))
    assert info.value.field == "checkpoint.dir" and ".metadata" in str(info.value)
    assert not (tmp_path / "out.pt").exists()


def test_exports_refuse_an_out_of_the_wrong_kind_before_reading_the_checkpoint(tmp_path):
    """No checkpoint here: the --out check comes first, naming the flag and the fix."""
    with pytest.raises(SpecError, match=r"`--out`: value .* is a directory, and export-merged writes one .pt file"):
        export_merged_weights(_lora(tmp_path), None, str(tmp_path))
    afile = tmp_path / "a.txt"
    afile.write_text("mine")
    llama = JobSpec.from_dict({**_lora(tmp_path).to_dict(), "model": {"arch": "llama", "lora": {"rank": 4}}})
    with pytest.raises(SpecError, match=r"`--out`: value .* is a file, and a Hugging Face checkpoint is a directory"):
        export_merged_weights(llama, None, str(afile), "hf")
    assert afile.read_text() == "mine"


def test_a_pt_base_that_is_not_a_state_dict_is_named_by_the_rank_that_loads_it(tmp_path):
    from workers.finetune import load_base

    pt = tmp_path / "base.pt"
    pt.write_bytes(b"not a zip archive" * 4)
    with pytest.raises(ValueError, match=r"base_checkpoint '.*base.pt' cannot be read as a state dict"):
        load_base(torch.nn.Linear(2, 2), pt)


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path):
    lines = ["data: {path: d}", "x0: &x0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10**9 values
    err = refused(tmp_path, "\n".join(lines) + "\n")
    assert "through YAML aliases" in str(err) and err.field is None


def test_runaway_nesting_is_refused_without_a_traceback(tmp_path):
    err = refused(tmp_path, "data: {path: d}\nx: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "too deep" in str(err)


@pytest.mark.parametrize("line, field", [("x: &a [*a]", "x"), ("faults: &a [*a]", "faults[0]")])
def test_a_recursive_alias_is_refused_by_name(tmp_path, line, field):
    assert refused(tmp_path, f"data: {{path: d}}\n{line}\n").field == field


@pytest.mark.parametrize("override, field", [
    ("model.moe.capacity_factor=1e300", "model.moe.capacity_factor"),
    ("model.moe.aux_loss_weight=1e300", "model.moe.aux_loss_weight"),
    ("model.moe.bias_update_rate=2", "model.moe.bias_update_rate"),
    ("parallel.bucket_mb=1e300", "parallel.bucket_mb"),
    ("plan.inter_node_gbps=1e300", "plan.inter_node_gbps"),
])
def test_huge_values_of_the_new_fields_are_refused_naming_the_field(tmp_path, override, field):
    text = "data: {path: /tmp/none}\nmodel: {d_model: 32, n_layers: 4, n_heads: 4, seq_len: 32, moe: {experts: 4}}\n"
    err = refused(tmp_path, text, override)
    assert err.field == field and "<=" in err.fix


@pytest.mark.parametrize("section", ["control", "metrics"])
@pytest.mark.parametrize("host, words", [
    ("", "every interface"),
    ("  ", "every interface"),
    ("http://node1", "without scheme or port"),
    ("node1:9000", "holds a port"),
])
def test_a_host_that_is_blank_or_not_an_address_is_refused_before_start(section, host, words):
    """A blank host binds every interface (the network, not loopback); a URL or host:port fails only at bind."""
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"data": {"path": "d"}, section: {"host": host}})
    assert info.value.field == f"{section}.host" and words in str(info.value) and "127.0.0.1" in str(info.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1", "node-1.cluster.local"])
def test_addresses_and_host_names_are_taken_as_hosts(host):
    assert JobSpec.from_dict({"data": {"path": "d"}, "control": {"host": host}}).control.host == host


@pytest.mark.parametrize("fault, field", [
    ({"kind": "kill_rank", "factor": 5}, "faults.0.factor"),
    ({"kind": "nan_loss", "shard": 1}, "faults.0.shard"),
])
def test_a_fault_option_its_kind_never_reads_is_refused(fault, field):
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"data": {"path": "d"}, "parallel": {"dp": 2}, "faults": [{"rank": 1, "at_step": 2,
                                                                                    **fault}]})
    assert info.value.field == field and f"remove {field}" in str(info.value)


def test_a_slow_rank_keeps_its_factor_through_a_round_trip():
    spec = JobSpec.from_dict({"data": {"path": "d"}, "parallel": {"dp": 2},
                              "faults": [{"kind": "slow_rank", "rank": 1, "at_step": 2, "factor": 5},
                                         {"kind": "kill_rank", "rank": 0, "at_step": 3}]})
    assert JobSpec.from_dict(spec.to_dict()).faults[0].factor == 5


@pytest.mark.parametrize("sections, field, fix", [
    ({"parallel": {"pp_schedule": "interleaved_1f1b"}}, "parallel.pp_schedule", "set parallel.pp: 2 or more"),
    ({"parallel": {"pp_schedule": "gpipe"}}, "parallel.pp_schedule", "remove parallel.pp_schedule"),
    ({"parallel": {"dp": 2, "cp_impl": "ulysses"}}, "parallel.cp_impl", "set parallel.cp: 2 or more"),
    ({"precision": {"initial_loss_scale": 1024}}, "precision.initial_loss_scale", "set precision.dtype: fp16"),
    ({"precision": {"dtype": "bf16", "initial_loss_scale": 1024}}, "precision.initial_loss_scale",
     "remove precision.initial_loss_scale"),
])
def test_a_setting_whose_feature_the_job_does_not_run_is_refused(sections, field, fix):
    """Each would be ignored: no pipeline at pp=1, no context split at cp=1, no loss scaling without fp16."""
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"data": {"path": "d"}, **sections})
    section, name = field.split(".")
    assert_actionable(info.value, field, sections[section][name], fix)


@pytest.mark.parametrize("sections", [
    {"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b"}, "model": {"n_layers": 4},
     "train": {"microbatches": 2}},
    {"parallel": {"cp": 2, "cp_impl": "allgather"}, "model": {"seq_len": 64}},
    {"precision": {"dtype": "fp16", "initial_loss_scale": 1024}},
    {"parallel": {"pp_schedule": "1f1b", "cp_impl": "ring"}, "precision": {"initial_loss_scale": 65536}},  # defaults
])
def test_the_same_settings_with_their_feature_or_at_their_defaults_load(sections):
    assert JobSpec.from_dict({"data": {"path": "d"}, **sections})
