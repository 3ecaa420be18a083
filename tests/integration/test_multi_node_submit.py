"""A job submitted through the job server of a two-node cluster trains with one rank on each node, and its
losses match the single-process reference."""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.reference import reference_losses
from tests.support.two_node_submit import submit_on_two_nodes


def test_a_submitted_job_spans_both_nodes_and_matches_the_reference(ray_cluster, token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2}, train={"steps": 3}, checkpoint={"every": 0})
    out = submit_on_two_nodes(spec.to_dict(), tmp_path)
    assert out["status"] == "SUCCEEDED", out["logs"]
    assert len(out["nodes"]) == 2
    ranks = out["summary"]["layout"]["ranks"]
    assert {r["node_id"] for r in ranks} == set(out["nodes"])  # one rank per node: the ranks really span both
    assert out["summary"]["losses"] == pytest.approx(reference_losses(spec, 3), rel=1e-4)
