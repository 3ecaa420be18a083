"""Joining or starting the Ray cluster a job runs on."""

from __future__ import annotations

import os

import ray


def connect(address: str | None, needed_cpus: float) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``, or the head ``ray start`` runs on this machine), else start a local
    Ray big enough for the grid.

    Ray's own ``ray.init()`` joins a running local head too, but refuses the CPU count a new cluster needs
    ("num_cpus ... must not be provided"), so the running head is looked for first (``address="auto"``)."""
    if ray.is_initialized():
        return
    from orchestrator.api.auth import use_ray_token_if_present

    use_ray_token_if_present()  # Ray sends its token to an explicit address only in token mode
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    try:
        ray.init(address="auto", log_to_driver=False)
    except ConnectionError:  # no head on this machine
        ray.init(num_cpus=max(int(needed_cpus + 0.999), os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False)


def available() -> tuple[float, float]:
    """(CPUs, GPUs) the cluster has in total."""
    res = ray.cluster_resources()
    return res.get("CPU", 0.0), res.get("GPU", 0.0)
