"""Topology-aware placement on a real 3-node Ray cluster (``ray.cluster_utils.Cluster``): every tensor-parallel
group and every context-parallel group runs on one node, as the planner's time model assumes, and the run dir's
summary.json records each rank's node beside its coordinates."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.elastic_cluster import run_on_cluster
from tests.support.jobs import tiny_spec


def _groups(ranks: list[dict], axis: str) -> dict[tuple, set[str]]:
    """The nodes of each group along ``axis``: ranks equal in every other coordinate."""
    out: dict[tuple, set[str]] = {}
    for r in ranks:
        key = tuple(sorted((k, v) for k, v in r["coords"].items() if k != axis))
        out.setdefault(key, set()).add(r["node_id"])
    return out


def test_every_tp_and_cp_group_is_placed_on_one_node(token_data, tmp_path):
    """tp=2 x cp=2 x dp=2 (8 ranks) on three 4-CPU nodes: two blocks of 4, each on one node of its own."""
    spec = tiny_spec(token_data, tmp_path, parallel={"dp": 2, "cp": 2, "tp": 2}, train={"steps": 2})
    out = run_on_cluster(spec, tmp_path, "--nodes", "3", "--cpus", "4")
    assert "error" not in out, out.get("error")
    summary = json.loads((Path(spec.resolved_run_dir()) / "summary.json").read_text())
    ranks = summary["layout"]["ranks"]
    assert len(ranks) == 8 and all(r["node_id"] for r in ranks)
    for axis in ("tp", "cp"):
        groups = _groups(ranks, axis)
        assert len(groups) == 4 and all(len(nodes) == 1 for nodes in groups.values()), (axis, groups)
    assert len({r["node_id"] for r in ranks}) == 2  # a block fills a node's 4 CPUs
