"""Which Ray node hosts a rank, which nodes a ``kill_node`` drill may take down, and which nodes are gone.

``kill_node`` kills the node's raylet, so it must not hit the head node (the
GCS and every other node hang on it) or the node the driver, and with it this
controller, is attached to: the drill would end the job it is meant to test.
A job-file fault is refused once placement is reserved and before any actor
starts; a live request (``raymesh inject``) when it arrives.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.util.placement_group import placement_group_table

from orchestrator.errors import SpecError

HEAD_RESOURCE = "node:__internal_head__"  # Ray gives this resource to the head node only
FIX = ("run the ranks on worker nodes (start the head with `ray start --head --num-cpus 0`, or give a "
       "ray.cluster_utils.Cluster head num_cpus=0), or use kind kill_rank")


def _protected() -> dict[str, str]:
    """node id -> why a kill_node may not take it down."""
    why = {n["NodeID"]: "the head node" for n in ray.nodes() if n["Alive"] and HEAD_RESOURCE in n["Resources"]}
    driver = ray.get_runtime_context().get_node_id()
    why[driver] = "the head node, where the driver runs" if driver in why else "the driver's node"
    return why


def refusal(rank: int, node_id: str) -> str | None:
    """Why ``kill_node`` on ``rank`` (living on ``node_id``) cannot apply, or None when it can."""
    why = _protected().get(node_id)
    if why is None:
        return None
    return f"kill_node: rank {rank} is placed on {why} ({node_id[:8]}); removing it would end the controller too"


def check_job_faults(faults: list[dict], placement) -> None:
    """Refuse a job file's ``kill_node`` whose rank landed on a protected node (``faults.N.rank``)."""
    for i, fault in enumerate(faults):
        if fault["kind"] != "kill_node":
            continue
        rank = fault["rank"]
        group, index = placement.bundle(rank)
        table = placement_group_table(placement.groups[group])
        problem = refusal(rank, table["bundles_to_node_id"][index])
        if problem:
            raise SpecError(f"faults.{i}.rank", rank, problem, FIX)


def gone(node_ids, probe_s: float = 1.0) -> set[str]:
    """The ones among ``node_ids`` that are gone: Ray no longer counts them alive, or their raylet no longer
    accepts a connection within ``probe_s``.

    Why the probe: Ray declares a node dead only once its health checks have missed (about 15 s on defaults, and
    later on a loaded head), while the survivors' failed step ends within a second or two. Asked then, Ray still
    counts the lost node alive, and the loss would be recorded (and counted in the metrics) as one rank's. A
    raylet that is gone refuses the connection at once (its host is up) or never answers (its host is down).
    """
    wanted = set(node_ids)
    listed = {n["NodeID"]: n for n in ray.nodes() if n["NodeID"] in wanted and n["Alive"]}
    with ThreadPoolExecutor(max(1, len(listed))) as pool:
        down = dict(zip(listed, pool.map(lambda n: raylet_down(n["NodeManagerAddress"], n["NodeManagerPort"],
                                                               probe_s), listed.values())))
    return {node for node in wanted if node not in listed or down[node]}


def raylet_down(address: str, port: int, timeout_s: float) -> bool:
    """Whether nothing accepts a TCP connection at ``address:port`` within ``timeout_s`` (the connection is
    closed at once: the raylet sees a client come and go)."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return False
    except OSError:
        return True
