"""Joining or starting the Ray cluster a job runs on."""

from __future__ import annotations

import os
import socket

import ray

PROBE_TIMEOUT_S = 5.0  # a head that does not accept a TCP connection in this long is taken as unreachable


def connect(address: str | None, needed_cpus: float) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``, or the head ``ray start`` runs on this machine), else start a local
    Ray big enough for the grid.

    Ray's own ``ray.init()`` joins a running local head too, but refuses the CPU count a new cluster needs
    ("num_cpus ... must not be provided"), so the running head is looked for first (``address="auto"``)."""
    if ray.is_initialized():
        return
    from orchestrator.api.auth import use_ray_token_if_present

    use_ray_token_if_present()  # Ray sends its token to an explicit address only in token mode
    source = "--address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        check_reachable(address, source)
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


def check_reachable(address: str, source: str) -> None:
    """``ConnectionError`` naming ``address``, where it came from (``source``) and the fix when nothing accepts a
    connection there: ``ray.init`` itself retries an unreachable head for over ten minutes before it says so.

    ``auto``, ``local`` and addresses without a port are left to Ray. The host is dialled as Ray dials it
    (``localhost`` and ``127.0.0.1`` become this node's address)."""
    dialled = _as_ray_dials(address)
    if dialled is None:
        return
    try:
        socket.create_connection(dialled, timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise ConnectionError(
            f"cannot reach a Ray cluster at {address} (from {source}; dialled {dialled[0]}:{dialled[1]}: {exc}); "
            f"fix: start it (`ray start --head`) or correct {source}: the head's GCS address HOST:PORT (port 6379 "
            "unless `ray start --port` chose another), or ray://HOST:10001 for Ray Client") from None


def _as_ray_dials(address: str) -> tuple[str, int] | None:
    """(host, port) that ``ray.init(address=...)`` connects to, or None when ``address`` names no port."""
    plain = address.removeprefix("ray://")
    host, _, port = plain.rpartition(":")
    if not host or not port.isdigit():
        return None
    if plain == address:  # a GCS address: Ray swaps loopback for the node's own address
        from ray._private.services import canonicalize_bootstrap_address

        try:
            host, _, port = canonicalize_bootstrap_address(address).rpartition(":")
        except Exception:  # Ray's own check reports a malformed address when it connects
            return None
    return host.strip("[]"), int(port)
