"""Topology-aware placement on a real 3-node Ray cluster (``ray.cluster_utils.Cluster``): every tensor-parallel
group and every context-parallel group runs on one node, consecutive pipeline stages on the same or the next
node in the ``raymesh.io/topology`` label's order, and the run dir's summary.json records each rank's node beside
its coordinates and the node order."""

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


def test_tp_and_cp_groups_share_a_node_and_pipeline_stages_follow_the_topology_order(token_data, tmp_path):
    """tp=2 x cp=2 x pp=2 (8 ranks) on three 4-CPU nodes labelled, as they join, rack-3, rack-1, rack-2: two
    blocks of 4, each filling a node; stage 0 on the first node in label order (the second to join), stage 1 on
    its neighbour (the third), which Ray alone would pick one time in six."""
    spec = tiny_spec(token_data, tmp_path, parallel={"pp": 2, "cp": 2, "tp": 2}, train={"steps": 2})
    out = run_on_cluster(spec, tmp_path, "--nodes", "3", "--cpus", "4", "--topology", "rack-3,rack-1,rack-2")
    assert "error" not in out, out.get("error")
    layout = json.loads((Path(spec.resolved_run_dir()) / "summary.json").read_text())["layout"]
    ranks = layout["ranks"]
    assert len(ranks) == 8 and all(r["node_id"] for r in ranks)
    for axis in ("tp", "cp"):
        groups = _groups(ranks, axis)
        assert len(groups) == 4 and all(len(nodes) == 1 for nodes in groups.values()), (axis, groups)
    order = [n["topology"] for n in layout["node_order"]]
    assert order == ["rack-1", "rack-2", "rack-3", ""]  # the labelled workers in label order, then the head
    position = {n["node_id"]: i for i, n in enumerate(layout["node_order"])}
    stage_nodes = [{position[r["node_id"]] for r in ranks if r["coords"]["pp"] == s} for s in range(2)]
    assert all(len(nodes) == 1 for nodes in stage_nodes)  # a stage's block on one node
    (first,), (second,) = stage_nodes
    assert layout["node_order"][first]["topology"] == "rack-1" and second == first + 1
