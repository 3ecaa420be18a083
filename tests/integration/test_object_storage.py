"""Checkpoints and token shards in object storage: an S3-compatible server (moto's) on 127.0.0.1, started here.

A dp=2 run saves to ``s3://`` after 2 steps; the same layout resumed from there repeats its next steps bit for
bit, and a tp=2 layout resumed from it (DCP resharding) matches to 1e-4. The checksum manifest, retention and
the corrupt-checkpoint path then run against the bucket. A dp=2 run reading its shards from the bucket trains
exactly like the one reading the local copy. No Ray: the ranks are the parity harness's spawned
processes, which inherit the credentials from this process's environment as Ray workers would from theirs.
"""

from __future__ import annotations

import pytest

from orchestrator.checkpoints import checksums
from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.errors import SpecError
from orchestrator.spec import check_before_start
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from tests.support.s3_server import s3_server

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
    assert ckpt.complete_steps() == [1, 2]
    assert ckpt.prune(2) == [1]
    assert ckpt.remove_leftovers() == [ckpt.path_for(3)]
    assert not s3.exists(f"{root}/step-00000001") and not s3.exists(f"{root}/step-00000003")


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
    with pytest.raises(SpecError, match=r"run_dir.*is a URL.*keep checkpoints in object storage"):
        check_before_start(ok.with_overrides([f"run_dir=s3://{BUCKET}/run"]))
