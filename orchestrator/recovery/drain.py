"""Nodes Ray is draining: the notice a node gets before it goes (``ray drain-node``, which autoscalers and KubeRay
send for a spot reclaim or a Kubernetes eviction, with a reason and a deadline).

Ray keeps a draining node alive until the caller takes it down at the deadline, schedules nothing new onto it,
and tells nobody running there; the controller asks the GCS once a second while ranks train
(``TrainingJob._check_drain``) and treats every rank on such a node as if its process had a preemption notice.
"""

from __future__ import annotations

import time


def draining(node_ids) -> dict[str, float | None]:
    """node -> seconds left until its drain deadline (None: the drain has none), for each of ``node_ids`` that Ray
    is draining. One call to the GCS (``GetDrainingNodes``), which answers with every draining node's deadline."""
    from ray._private.state import state

    try:
        listed = state.get_draining_nodes()
    except Exception:  # the GCS did not answer this once (its client raises its own kinds): asked again in a second
        return {}
    wanted = set(node_ids)
    now_ms = time.time() * 1000
    return {node: (max(0.0, (deadline_ms - now_ms) / 1000) if deadline_ms else None)
            for node, deadline_ms in listed.items() if node in wanted}


def live_nodes(nodes: list[dict]) -> list[dict]:
    """``ray.nodes()``'s entries of the nodes a new placement may use: alive and not being drained (a node being
    drained goes soon; a rank placed there would be preempted again)."""
    alive = [node for node in nodes if node["Alive"]]
    leaving = draining(node["NodeID"] for node in alive)
    return [node for node in alive if node["NodeID"] not in leaving]
