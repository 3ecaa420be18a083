"""``RayRuntime``: the ``Runtime`` (``group.py``) the controller gets by default, on a real Ray cluster.

Each method imports its Ray-side module when first called, so the controller, and the tests that hand it a fake
runtime, load no Ray code they do not use. A module of its own so that the seam (``group.py``) imports nothing of
``rank_group.py``, which builds on the seam.
"""

from __future__ import annotations

from orchestrator.spec import JobSpec


class RayRuntime:
    """The real thing: Ray placement groups and ``RankWorker`` actors (imported lazily, so the fake needs no Ray)."""

    def preflight(self, spec: JobSpec) -> None:
        from orchestrator.planning.disk_check import check_offload_space
        from orchestrator.planning.memory_report import warn_if_too_big
        from orchestrator.spec import check_before_start

        check_before_start(spec)
        check_offload_space(spec)
        warn_if_too_big(spec)

    def connect(self, address: str | None, needed_cpus: float) -> None:
        from orchestrator.runtime import cluster

        cluster.connect(address, needed_cpus)

    def available(self) -> tuple[float, float]:
        from orchestrator.runtime import cluster

        return cluster.available()

    def reserve(self, spec: JobSpec, use_gpu: bool, timeout_s: float):
        from orchestrator.runtime.placement import reserve

        return reserve(spec, use_gpu, timeout_s)

    def start_group(self, spec: JobSpec, placement, use_gpu: bool):
        from orchestrator.runtime.rank_group import RankGroup

        return RankGroup(spec, placement, use_gpu)

    def check_job_faults(self, faults: list[dict], placement) -> None:
        from orchestrator.recovery import node_loss

        node_loss.check_job_faults(faults, placement)

    def kill_node_refusal(self, rank: int, node_id: str) -> str | None:
        from orchestrator.recovery import node_loss

        return node_loss.refusal(rank, node_id)

    def nodes_gone(self, node_ids) -> set[str]:
        from orchestrator.recovery import node_loss

        return node_loss.gone(node_ids)

    def draining(self, node_ids) -> dict[str, float | None]:
        from orchestrator.recovery import drain

        return drain.draining(node_ids)

    def elastic(self, spec: JobSpec):
        from orchestrator.recovery.elastic import ElasticPolicy
        from orchestrator.runtime.placement import can_reserve

        return ElasticPolicy(spec, can_reserve)

    def serve_control(self, job):
        from orchestrator.api.control_server import ControlServer

        return ControlServer.for_job(job)
