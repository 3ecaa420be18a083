"""A job submitted through the job server of a two-node cluster trains with one rank on each node, its losses
match the single-process reference, and its data and checkpoints live in S3 (moto's server on 127.0.0.1): the
real job path (driver checks, controller bookkeeping, ranks' DCP saves) against a bucket, from both nodes."""

from __future__ import annotations

import pytest

from orchestrator.checkpoints import checksums
from orchestrator.checkpoints.directory import CheckpointDir
from tests.support.jobs import tiny_spec
from tests.support.reference import reference_losses
from tests.support.s3_server import s3_server
from tests.support.two_node_submit import submit_on_two_nodes

BUCKET = "raymesh-nodes"


def test_a_submitted_job_spans_both_nodes_and_matches_the_reference(ray_cluster, token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2}, train={"steps": 3},
                     checkpoint={"every": 2, "dir": f"s3://{BUCKET}/ckpt"})
    with s3_server(BUCKET) as s3:  # the cluster's nodes start inside, so they inherit its AWS_* variables
        s3.put(str(token_data), f"s3://{BUCKET}/data", recursive=True)
        on_s3 = spec.with_overrides([f"data.path=s3://{BUCKET}/data"])
        out = submit_on_two_nodes(on_s3.to_dict(), tmp_path)
        assert out["status"] == "SUCCEEDED", out["logs"]
        ckpt = CheckpointDir(f"s3://{BUCKET}/ckpt", keep=3)
        assert ckpt.complete_steps() == [2, 3]  # every 2 steps and at the last
        assert all(checksums.problem(ckpt.path_for(step)) is None for step in (2, 3))
        assert {key.rsplit("/", 1)[1] for key in s3.find(str(ckpt.path_for(3)))} >= {"__0_0.distcp", "__1_0.distcp"}
    assert len(out["nodes"]) == 2
    ranks = out["summary"]["layout"]["ranks"]
    assert {r["node_id"] for r in ranks} == set(out["nodes"])  # one rank per node: the ranks really span both
    assert out["summary"]["losses"] == pytest.approx(reference_losses(spec, 3), rel=1e-4)
