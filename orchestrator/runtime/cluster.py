"""Joining or starting the Ray cluster a job runs on."""

from __future__ import annotations

import os

import ray


def connect(address: str | None, needed_cpus: float) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``), else start a local Ray big enough for the grid."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        from orchestrator.api.auth import use_ray_token_if_present

        use_ray_token_if_present()  # Ray sends its token to an explicit address only in token mode
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(
            num_cpus=max(int(needed_cpus + 0.999), os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=False,
        )


def available() -> tuple[float, float]:
    """(CPUs, GPUs) the cluster has in total."""
    res = ray.cluster_resources()
    return res.get("CPU", 0.0), res.get("GPU", 0.0)
