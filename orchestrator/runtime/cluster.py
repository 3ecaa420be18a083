"""Joining or starting the Ray cluster a job runs on.

Which one, in this order: the cluster the user named (``--address``, else ``RAY_ADDRESS``); else the head
``ray start --head`` runs on this machine for this user; else a private local Ray of the job's own. Never another
program's private ``ray.init()``: Ray's ``address="auto"`` joins any Ray it finds running here, and a job that
joined a notebook's or a test's local instance died with it when that program exited. ``event=cluster`` says
which cluster was joined, how it was found and what was passed over.

A ``ray start`` head and a driver's private instance look alike from outside (the same GCS and raylet
processes); what tells them apart is their parent. Ray names each session after the process that started it
(``session_<date>_<time>_<pid>``); ``ray start`` starts the node's processes and exits (they then belong to init,
or to ``ray start --block`` where that still runs), while a driver's ``ray.init()`` stays their parent for as
long as it runs, and they end with it.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass

import ray

from orchestrator.events import event

PROBE_TIMEOUT_S = 5.0  # a head that does not accept a TCP connection in this long is taken as unreachable


@dataclass(frozen=True)
class LocalRay:
    """A Ray cluster with a node (its raylet, ``pid``) on this machine."""

    address: str  # the GCS address drivers join: NODE_IP:PORT
    pid: int  # its raylet on this machine
    uid: int  # the user its processes run as
    starter: int  # the process that started it (the pid its session name ends with)
    started_by: str  # "ray start", or "driver": a program's own ``ray.init()``, which ends with that program
    starter_cmd: str  # that program's command line ("" once it has exited)

    def describe(self) -> str:
        """What it is, for ``event=cluster``'s ``passed_over``."""
        if self.started_by == "driver":
            return f"{self.address} (the private ray.init() of pid {self.starter}: {self.starter_cmd[:80]})"
        return f"{self.address} (ray start head of uid {self.uid})"


def connect(address: str | None, needed_cpus: float) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``, or the head ``ray start`` runs on this machine for this user), else
    start a private local Ray big enough for the grid; ``event=cluster`` says which and why.

    Ray's ``ray.init(address="auto")`` would join any Ray running here, a program's private ``ray.init()`` too,
    and Ray refuses the CPU count of a new cluster (``num_cpus ... must not be provided``) where its own
    ``ray.init()`` finds a head to join, so a new one is asked for by name (``address="local"``)."""
    if ray.is_initialized():
        return
    joined, passed_over = _join_known(address, "--address")
    if joined:
        return
    ray.init(address="local", num_cpus=max(int(needed_cpus + 0.999), os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False)
    _joined(ray.get_runtime_context().gcs_address, "started", passed_over)


def join(address: str | None, option: str) -> None:
    """Join the cluster a follower looks for a job on (never start one): the one named (``option``, else
    ``RAY_ADDRESS``), else this user's ``ray start`` head, else the private Ray a ``raymesh run`` on this
    machine started (a run hosted there lives as long as that command). ``ConnectionError`` when there is none."""
    if ray.is_initialized():
        return
    joined, passed_over = _join_known(address, option)
    if joined:
        return
    ours = [h for h in passed_over if h.started_by == "driver" and _is_raymesh(h.starter_cmd.split())]
    if not ours:
        raise ConnectionError("no Ray head started by `ray start` (nor a `raymesh run`'s own Ray) runs on this "
                              f"machine for uid {os.getuid()}" + "".join(f"; passed over {h.describe()}"
                                                                         for h in passed_over))
    _join(ours[-1].address, "raymesh run", [h for h in passed_over if h is not ours[-1]])


def _join_known(address: str | None, option: str) -> tuple[bool, list[LocalRay]]:
    """Join the cluster the user named (``option`` or ``RAY_ADDRESS``), else this user's ``ray start`` head:
    whether one was joined, and the local clusters passed over."""
    from orchestrator.api.auth import use_ray_token_if_present

    use_ray_token_if_present()  # Ray sends its token to an explicit address only in token mode
    named = named_address(address, option)
    if named is not None:
        _join(*named)
        return True, []
    head, passed_over = ray_start_head()
    if head is not None:
        _join(head.address, "ray start", passed_over)
    return head is not None, passed_over


def named_address(address: str | None, option: str) -> tuple[str, str] | None:
    """(address, where it came from) when the user named a cluster: ``option`` (e.g. ``--address``), else a
    non-empty ``RAY_ADDRESS``; None when neither did."""
    if address:
        return address, option
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return None


def _join(address: str, found_by: str, passed_over: list[LocalRay] = ()) -> None:
    """Join the cluster at ``address`` (a named one that is unreachable is said as such, at once) and say so."""
    if found_by in ("--address", "--ray-address", "RAY_ADDRESS"):
        check_reachable(address, found_by)
    ray.init(address=address, log_to_driver=False)
    _joined(address, found_by, passed_over)


def _joined(address: str, found_by: str, passed_over: list[LocalRay]) -> None:
    skipped = {"passed_over": "; ".join(h.describe() for h in passed_over)} if passed_over else {}
    event("cluster", address=address, found_by=found_by, **skipped)


def ray_start_head() -> tuple[LocalRay | None, list[LocalRay]]:
    """The head ``ray start`` runs on this machine for this user (the one ``ray start`` last wrote into Ray's
    ``ray_current_cluster`` where several do, else the newest), and the local clusters passed over: other
    programs' private ``ray.init()`` and other users' heads."""
    heads = local_heads()
    ours = [h for h in heads if h.started_by == "ray start" and h.uid == os.getuid()]
    if not ours:
        return None, heads
    latest = ray._private.utils.read_ray_address()
    head = next((h for h in ours if h.address == latest), ours[-1])
    return head, [h for h in heads if h is not head]


def local_heads() -> list[LocalRay]:
    """The Ray clusters with a node on this machine, oldest first: found as Ray itself finds them, by the
    ``--gcs-address`` in a raylet's command line (a driver's own GCS listens on a port chosen at start, named
    nowhere else), one entry per cluster (a ``ray.cluster_utils.Cluster`` runs several raylets here)."""
    import psutil  # after ray: Ray's own copy (ray/thirdparty_files)

    found: dict[str, tuple[float, LocalRay]] = {}
    for proc in psutil.process_iter(["pid", "ppid", "uids", "cmdline", "create_time"]):
        head = _cluster_of(proc.info)
        if head is not None and head.address not in found:
            found[head.address] = (proc.info["create_time"], head)
    return [head for _, head in sorted(found.values(), key=lambda pair: pair[0])]


def _cluster_of(info: dict) -> LocalRay | None:
    """The cluster of the raylet process ``info`` (psutil's fields) describes, else None."""
    cmdline = info.get("cmdline") or []
    if not cmdline or os.path.basename(cmdline[0]) != "raylet":
        return None
    # the flags Ray passes its workers sit inside one argument (``--python_worker_command``): split as Ray does
    flags = dict(word.split("=", 1) for arg in cmdline[1:] for word in arg.split(" ")
                 if word.startswith("--") and "=" in word)
    address, starter = flags.get("--gcs-address", ""), flags.get("--session-name", "").rsplit("_", 1)[-1]
    if not address or not starter.isdigit():
        return None
    starter_cmd = _command_line(int(starter))
    private = info["ppid"] == int(starter) and not _is_ray_start(starter_cmd)
    return LocalRay(address=address, pid=info["pid"], uid=info["uids"].real, starter=int(starter),
                    started_by="driver" if private else "ray start", starter_cmd=" ".join(starter_cmd))


def _is_raymesh(cmdline: list[str]) -> bool:
    """Whether ``cmdline`` is a ``raymesh`` command (the console script, or ``python -m orchestrator.cli``)."""
    return any(os.path.basename(arg) == "raymesh" or arg == "orchestrator.cli" for arg in cmdline[:3])


def _command_line(pid: int) -> list[str]:
    """``pid``'s command line; empty when it has exited (or is not ours to read)."""
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _is_ray_start(cmdline: list[str]) -> bool:
    """Whether ``cmdline`` is ``ray start ...`` (``--block`` keeps it running as its head's parent)."""
    words = [os.path.basename(arg) for arg in cmdline]
    return any(word in ("ray", "ray.scripts.scripts") and nxt == "start" for word, nxt in itertools.pairwise(words))


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
