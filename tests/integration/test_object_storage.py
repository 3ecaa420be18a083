"""Checkpoints and token shards in object storage: an S3-compatible server (moto's) on 127.0.0.1, started here.

A dp=2 run saves to ``s3://`` after 2 steps; the same layout resumed from there repeats its next steps bit for
bit, and a tp=2 layout resumed from it (DCP resharding) matches to 1e-4. The checksum manifest, retention and
the corrupt-checkpoint path then run against the bucket. A dp=2 run reading its shards from the bucket trains
exactly like the one reading the local copy. No Ray: the ranks are the parity harness's spawned
processes, which inherit the credentials from this process's environment as Ray workers would from theirs.

A run dir in the bucket: the controller (on the fake rank group, so no Ray either) loses its machine after its
checkpoint at step 5, and the bucket still holds the records up to that step; the resume, on a machine without
the staging directory, appends to them, and `raymesh report URL` draws from them into the bucket.
`prepare-data --out s3://...` and `export-hf` from and to the bucket write what they write locally.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from orchestrator.checkpoints import checksums
from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.errors import SpecError
from orchestrator.spec import check_before_start
from tests.support.gcs_server import gcs_server
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.s3_server import s3_server
from tests.support.tracker_records import tensorboard_series

BUCKET = "raymesh-test"
STEPS = 4


@pytest.fixture(scope="module")
def s3():
    with s3_server(BUCKET) as fs:
        yield fs


@pytest.fixture(scope="module")
def runs(s3, token_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("s3")
    url = f"s3://{BUCKET}/run/checkpoints/step-00000002"
    data_url = f"s3://{BUCKET}/data"
    s3.put(str(token_data), data_url, recursive=True)
    specs = [tiny_spec(data, tmp / name, parallel=layout).worker_dict() for name, layout, data in (
        ("saved", {"dp": 2}, token_data), ("resumed", {"dp": 2}, token_data), ("resharded", {"tp": 2}, token_data),
        ("s3_data", {"dp": 2}, data_url))]
    saved, resumed, resharded, s3_data = run_layouts(
        specs, 2, STEPS, checkpoints=[url, None, None, None], resumes=[None, url, url, None],
        save_afters=[2, None, None, None])
    return {"url": url, "saved": saved, "resumed": resumed, "resharded": resharded, "s3_data": s3_data,
            "data_url": data_url}


def test_a_checkpoint_in_s3_resumes_bit_identically_and_reshards(runs, s3):
    saved = runs["saved"]
    assert runs["resumed"].losses[:2] == saved.losses[2:]  # weights, Adam moments, LR and data position
    assert runs["resumed"].grad_norms[:2] == saved.grad_norms[2:]
    assert runs["resharded"].losses[:2] == pytest.approx(saved.losses[2:], rel=1e-4)
    names = {path.rsplit("/", 1)[1] for path in s3.find(runs["url"])}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", checksums.MANIFEST} <= names


def test_token_shards_in_s3_train_exactly_like_the_local_copy(runs, s3, token_data):
    assert runs["s3_data"].losses == runs["saved"].losses  # same shards, read by range requests
    spec = tiny_spec(runs["data_url"], token_data.parent / "s3check")
    check_before_start(spec)  # the manifest is found and read through the bucket
    with pytest.raises(SpecError, match=r"data\.path.*has no prepared data"):
        check_before_start(spec.with_overrides([f"data.path=s3://{BUCKET}/nothing-here"]))


def test_checksums_and_retention_work_in_the_bucket(runs, s3):
    root = f"s3://{BUCKET}/run/checkpoints"
    ckpt = CheckpointDir(root, keep=1)
    assert ckpt.complete_steps() == [2] and checksums.problem(runs["url"]) is None
    s3.copy(runs["url"], f"{root}/step-00000001", recursive=True)  # an older sealed save to retire
    s3.pipe(f"{root}/step-00000003/__0_0.distcp", b"cut short")  # a save with no manifest: never loadable
    ckpt.begin(4)
    s3.pipe(f"{root}/step-00000004/__0_0.distcp", b"cut short")  # this process's save that failed
    assert ckpt.complete_steps() == [1, 2]
    assert ckpt.prune(2) == [1]
    assert ckpt.remove_leftovers() == [ckpt.path_for(4)]  # this process's own, and only it
    assert ckpt.set_aside_unsealed() == [ckpt.path_for(3).with_name("step-00000003.unsealed")]  # kept, renamed
    assert not s3.exists(f"{root}/step-00000001") and not s3.exists(f"{root}/step-00000004")
    assert s3.exists(f"{root}/step-00000003.unsealed/__0_0.distcp") and not s3.exists(f"{root}/step-00000003")


def test_a_corrupted_object_is_found_and_set_aside(runs, s3, tmp_path):
    root = f"s3://{BUCKET}/corrupt"
    s3.copy(runs["url"], f"{root}/step-00000002", recursive=True)
    shard = f"{root}/step-00000002/__1_0.distcp"
    data = bytearray(s3.cat(shard))
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size: only the CRC can tell
    s3.pipe(shard, bytes(data))
    assert checksums.problem(f"{root}/step-00000002") == "__1_0.distcp fails its CRC-32 check"
    ckpt = CheckpointDir(root, keep=3)
    assert ckpt.latest_verified("resume") is None
    assert ckpt.skipped[0]["problem"] == "__1_0.distcp fails its CRC-32 check"
    assert s3.exists(f"{root}/step-00000002.corrupt/.metadata") and not s3.exists(f"{root}/step-00000002")


def test_checkpoint_dir_urls_are_checked_before_start(s3, token_data, tmp_path):
    ok = tiny_spec(token_data, tmp_path, checkpoint={"dir": f"s3://{BUCKET}/jobs/a"})
    check_before_start(ok)
    with pytest.raises(SpecError, match=r"checkpoint\.dir.*bucket 'no-such-bucket', which does not exist"):
        check_before_start(tiny_spec(token_data, tmp_path, checkpoint={"dir": "s3://no-such-bucket/a"}))
    check_before_start(ok.with_overrides([f"run_dir=s3://{BUCKET}/run"]))  # staged locally, copied up
    with pytest.raises(SpecError, match=r"run_dir.*bucket 'no-such-bucket', which does not exist"):
        check_before_start(ok.with_overrides(["run_dir=s3://no-such-bucket/run"]))
    with pytest.raises(SpecError, match=r"loggers\.tensorboard\.dir.*is a URL.*set run_dir to the URL"):
        check_before_start(ok.with_overrides([f"loggers.tensorboard.dir=s3://{BUCKET}/tb"]))
    for field in ("run_dir", "checkpoint.dir", "data.path"):
        with pytest.raises(SpecError, match=rf"{field}.*nope://b/x.*is a URL whose scheme no installed file system "
                                            r"serves.*use s3://"):
            check_before_start(ok.with_overrides([f"{field}=nope://b/x"]))


# -- run_dir, report, prepare-data and export-hf in the bucket (no ranks: the controller runs on a fake group) --


@pytest.fixture(scope="module")
def gcs():
    with gcs_server(BUCKET) as fs:
        yield fs


@pytest.fixture(params=["s3", "gs"])
def store(request):
    """(scheme, its fsspec file system): moto's S3 server, or the GCS emulator."""
    return request.param, request.getfixturevalue({"s3": "s3", "gs": "gcs"}[request.param])


@pytest.fixture
def staging(tmp_path, monkeypatch):
    """Run-dir staging directories under this test's tmp_path (they live in the temp directory)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp" / "raymesh-staging"


def _fake_job(token_data, tmp_path, url, runtime, resume=False):
    from orchestrator.runtime.controller import TrainingJob

    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2}, loggers={"tensorboard": {}},
                     checkpoint={"every": 5, "async": False, "dir": str(tmp_path / "ck")})
    return TrainingJob(spec.with_overrides([f"run_dir={url}"]), resume=resume, progress=False, runtime=runtime)


def test_a_run_dir_in_the_bucket_survives_a_lost_controller_and_the_report_reads_it(store, token_data, tmp_path,
                                                                                   staging, capsys):
    from orchestrator.cli.commands import main
    from tests.support.fake_group import FakeRuntime

    scheme, fs = store
    url = f"{scheme}://{BUCKET}/runs/fake"
    runtime = FakeRuntime()
    job = _fake_job(token_data, tmp_path, url, runtime)
    local = job.run_dir
    assert local.parent == staging and job.spec.checkpoint_dir() == tmp_path / "ck"
    local.mkdir(parents=True)
    (local / "control_token").write_text("secret")

    def lose_the_machine():  # the controller's machine dies: nothing more is copied up from it
        job.upload.push = list
        raise RuntimeError("node lost")

    runtime.script[8] = lose_the_machine
    with pytest.raises(RuntimeError, match="node lost"):
        job.run()
    shutil.rmtree(local)  # and its staging directory is gone with it
    steps = [json.loads(line)["step"] for line in fs.cat(f"{url}/steps.jsonl").decode().splitlines()]
    assert steps == [1, 2, 3, 4, 5]  # copied at the checkpoint's step, with its record; 6 and 7 were lost

    result = _fake_job(token_data, tmp_path, url, FakeRuntime(), resume=True).run()  # a new machine: no staging
    assert result.resumed_from.endswith("step-00000005") and result.run_dir == url
    steps = [json.loads(line)["step"] for line in fs.cat(f"{url}/steps.jsonl").decode().splitlines()]
    assert steps == list(range(1, 11))  # the uploaded records, then the resumed steps: each step once
    summary = json.loads(fs.cat(f"{url}/summary.json"))
    assert summary["status"] == "finished" and summary["steps"] == 10 and summary["run_dir"] == url
    assert not fs.exists(f"{url}/control_token")
    fs.get(f"{url}/tensorboard", str(tmp_path / "tb"), recursive=True)  # the tracker's files went up too
    read = dict(tensorboard_series(tmp_path / "tb", "loss"))
    assert [read[s] for s in range(6, 11)] == pytest.approx(result.losses, rel=1e-6)  # float32 there

    assert main(["report", url]) == 0
    assert f"report: {url}/report/index.html" in capsys.readouterr().out
    assert fs.cat(f"{url}/report/loss.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert url in fs.cat(f"{url}/report/index.html").decode()


def test_prepare_data_writes_to_the_bucket_as_it_writes_a_directory(s3, tmp_path):
    from orchestrator.cli.commands import main

    source = [Path(sysconfig.get_paths()["stdlib"]) / "json" / "encoder.py"]
    url = f"s3://{BUCKET}/prepared"
    argv = ["prepare-data", "--source", str(source[0]), "--tokenizer", "bpe:300"]
    assert main([*argv, "--out", url, "--shard-tokens", "2000"]) == 0
    assert len(s3.glob(f"{url}/shard-*.parquet")) > 1
    assert main([*argv, "--out", url]) == 0  # fewer, larger shards: the earlier ones go, as in a directory
    assert main([*argv, "--out", str(tmp_path / "local")]) == 0
    local = json.loads((tmp_path / "local" / "manifest.json").read_text())
    remote = json.loads(s3.cat(f"{url}/manifest.json"))
    assert remote["tokenizer"]["path"] == f"{url}/tokenizer.json"  # where the trained tokenizer went
    assert {k: v for k, v in remote.items() if k != "tokenizer"} == {k: v for k, v in local.items() if k != "tokenizer"}
    assert sorted(p.rsplit("/", 1)[1] for p in s3.find(url)) == ["manifest.json", "shard-00000.parquet",
                                                                   "tokenizer.json"]
    assert s3.cat(f"{url}/shard-00000.parquet") == (tmp_path / "local" / "shard-00000.parquet").read_bytes()


def test_export_hf_reads_a_checkpoint_in_the_bucket_and_writes_to_one(store, token_data, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from orchestrator.spec.lora import export_hf_weights
    from workers.model.hf_io import hf_name
    from workers.model.meta_init import build_full
    from workers.spec import WorkerSpec

    scheme, fs = store
    root = f"{scheme}://{BUCKET}/llama/checkpoints"
    spec = tiny_spec(token_data, tmp_path, model={"arch": "llama"}, checkpoint={"dir": root})
    model = build_full(WorkerSpec.from_dict(spec.worker_dict()).model, spec.train.seed + 1)  # not the job's init
    # saved here and copied up: the GCS emulator has no moveTo, so gcsfs's rename of DCP's .metadata.tmp would retry
    # for 30 s before its copy/delete fallback (saving into a bucket is the ranks' part, tested above for S3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "saved"), no_dist=True)
    fs.put(str(tmp_path / "saved"), f"{root}/step-00000002", recursive=True)
    checksums.write_manifest(f"{root}/step-00000002")
    out = export_hf_weights(spec, None, f"{scheme}://{BUCKET}/llama/hf")  # the job's newest checkpoint, there
    assert str(out) == f"{scheme}://{BUCKET}/llama/hf"
    fs.get(str(out), str(tmp_path / "hf"), recursive=True)
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    held = model.state_dict()
    assert set(exported) == {hf_name(k) for k in held}
    assert all(torch.equal(exported[hf_name(k)], v) for k, v in held.items())
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in exported.items())
