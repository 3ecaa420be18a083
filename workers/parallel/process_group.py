"""Process-group and DeviceMesh setup for one rank (grid order and mesh dims: ``workers.contract.grid``)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workers.contract.grid import Grid


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_mesh(
    rank: int, world_size: int, master_addr: str, master_port: int, grid: Grid,
    device: torch.device, timeout_s: float = 300.0, listener: socket.socket | None = None,
) -> DeviceMesh:
    """Join the job's process group (gloo on CPU, NCCL on GPU) and build the mesh named by ``grid.mesh_dims``.

    Every group gets ``timeout_s``: when a peer dies, survivors blocked in a collective
    with it (or with a survivor that already gave up) must fail within that time so the
    controller can re-form the group; sub-groups would otherwise get PyTorch's 30 minutes.
    ``listener`` is rank 0's socket for the store, already bound (see ``join_store``).
    """
    if not dist.is_initialized():
        join_group(rank, world_size, master_addr, master_port, _backend(device), timeout_s, listener)
    forget_previous_meshes()
    return _mesh(device, grid.mesh_shape, grid.mesh_dims, timeout_s)


def join_group(rank: int, world_size: int, addr: str, port: int, backend: str, timeout_s: float,
               listener: socket.socket | None = None) -> None:
    """Join the default process group through rank 0's store on ``addr`` (``join_store``); a loopback ``addr``
    keeps gloo's and NCCL's links on loopback too."""
    timeout = timedelta(seconds=timeout_s)
    if is_loopback(addr):
        keep_links_on_loopback()
    if backend == "nccl":
        keep_survivors_on_nccl_errors()
    store = join_store(rank, world_size, addr, port, timeout, listener)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def forget_previous_meshes() -> None:
    """Drop DTensor's cached sharding decisions, which may hold a mesh of a process group destroyed since.

    Works around torch (seen on 2.13): ``DeviceMesh.__eq__``/``__hash__`` compare ranks, layout and dim
    names but not the mesh's process groups, and DTensor caches each op's output spec (mesh included) keyed on
    its inputs' specs. After ``destroy_process_group`` and a new group in the same process (a Ray survivor
    re-forming its group in recovery, or several jobs in one process), an op on the new mesh can hit an entry
    made with the old one, equal by those rules, and its result then names the old mesh's group names: a
    name no longer registered ("Could not resolve the process group registered under the name N", as in
    ``torch.distributed.pipelining``'s first step), or worse, a name the new job gave to another group. Emptying
    the caches whenever a group is joined makes every spec from then on carry a mesh of the live group.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def join_store(rank: int, world_size: int, addr: str, port: int, timeout: timedelta,
               listener: socket.socket | None = None) -> dist.TCPStore:
    """The rendezvous store; rank 0 serves it on ``addr`` only.

    Why not ``init_method="tcp://..."``: torch's store then listens on every interface of rank 0's host, so
    anyone who can reach the host can write into an unauthenticated rendezvous. Rank 0 binds the socket
    itself, on loopback for a one-node job and on the node's cluster address otherwise, and hands it to the
    store. The controller's rank 0 binds it when it picks the port (``RankWorker.rendezvous_address``), so no
    other process can take the port in between.
    """
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    listener = listener or listen_on(addr, port)
    return dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach())


def join_on_loopback(rank: int, world_size: int, port: int, timeout_s: float = 300.0,
                     listener: socket.socket | None = None) -> None:
    """Join a gloo group of processes on this host alone (the benchmarks' and tests' own ranks): the store and
    gloo's links listen on loopback only, as a one-node job's do (``init_method="tcp://..."`` would open the
    store on every interface, see ``join_store``). ``listener``: rank 0's socket already bound to ``port``."""
    join_group(rank, world_size, "127.0.0.1", port, "gloo", timeout_s, listener)


def listen_on(addr: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``addr`` alone (``port`` 0: any free one)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(128)
    return sock


def is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


LINK_INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def keep_links_on_loopback() -> None:
    """Make gloo's and NCCL's own listening sockets loopback-only too, for a job whose ranks share one host.

    Both pick an interface from the host name otherwise, which can be a public one. A value the user set is
    kept. Nothing changes where no loopback interface is known by name (``lo`` on Linux, ``lo0`` on macOS).
    """
    names = {name for _, name in socket.if_nameindex()}
    lo = next((n for n in ("lo", "lo0") if n in names), None)
    for var in LINK_INTERFACE_VARS if lo else ():
        os.environ.setdefault(var, lo)


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def keep_survivors_on_nccl_errors() -> None:
    """Have NCCL's watchdog abort a failed or timed-out communicator and raise, without ending the process.

    PyTorch's default (3 on the torch versions raymesh runs) tears the whole process down when a collective
    fails or times out: every survivor of a lost rank would die with it, and the in-memory recovery that
    keeps survivors and re-forms the group (``RankWorker.setup``) would have nobody left to keep. ``2``
    (CleanUpOnly) aborts the communicator, so its kernels end and the next collective raises
    ``RankStepError``'s ``peer_lost``; the rank then destroys the group and joins the new one. Set before the
    group exists (NCCL reads it then); a value the user set is kept. Read on a GPU only: not yet measured
    there (``benchmarks/gpu.py --check-abort`` compares both settings).
    """
    os.environ.setdefault(NCCL_ERROR_HANDLING, "2")


def init_expert_mesh(grid: Grid, device: torch.device, timeout_s: float = 300.0) -> DeviceMesh | None:
    """The ``edp × ep × pp × tp`` mesh of an expert-parallel job (``Grid.expert_mesh_shape``), None at
    ep=1.

    A second mesh over the same ranks, so the job's own mesh keeps its dims: ``ep`` groups exchange tokens,
    ``edp`` groups reduce the experts' gradients (``workers.parallel.expert_parallel``), ``tp`` groups split each
    expert under ``parallel.expert_tp`` and ``ep_tp`` (with tp > 1) sums those experts' gradient norm.
    """
    if not grid.ep_enabled:
        return None
    override = _override(device, timeout_s)
    ranks = torch.tensor(grid.expert_mesh_ranks(), dtype=torch.int)  # not row-major under cp: pp sits between
    mesh = DeviceMesh(device.type, ranks, mesh_dim_names=Grid.EXPERT_MESH_DIMS,
                      backend_override=(override,) * len(Grid.EXPERT_MESH_DIMS))
    if grid.tp_enabled:  # expert tensor parallelism's experts differ along ep and tp: their norm sums over both
        mesh["ep", "tp"]._flatten(EP_TP, backend_override=override)
    return mesh


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _override(device: torch.device, timeout_s: float) -> tuple:
    """``(backend, options)`` for a mesh dim's group: gloo or NCCL with ``timeout_s``."""
    backend = _backend(device)
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    return backend, options


def _mesh(device: torch.device, shape: tuple[int, ...], dims: tuple[str, ...], timeout_s: float) -> DeviceMesh:
    """A mesh whose every sub-group gets ``timeout_s`` (see ``init_mesh``)."""
    override = _override(device, timeout_s)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=dims, backend_override=dict.fromkeys(dims, override))
    for name, parts in _flattened(dims).items():  # flattened dims must exist on the root before anyone slices them
        mesh[parts]._flatten(name, backend_override=override)
    return mesh


def _flattened(dims: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The flattened dims a mesh of ``dims`` names, each with the dims it joins: ``dp_cp`` under cp; under hybrid
    sharding also ``dp`` (every data-parallel rank, as on a plain mesh) and, with cp, ``dp_shard_cp`` (the ranks
    one ZeRO shard group spans)."""
    if "dp_shard" not in dims:
        return {DP_CP: ("dp", "cp")} if "cp" in dims else {}
    out = {"dp": ("dp_replicate", "dp_shard")}
    if "cp" in dims:
        out |= {DP_CP: ("dp_replicate", "dp_shard", "cp"), DP_SHARD_CP: ("dp_shard", "cp")}
    return out


DP_CP = "dp_cp"
EP_TP = "ep_tp"
DP_SHARD_CP = "dp_shard_cp"


def data_parallel_mesh(mesh: DeviceMesh, grid: Grid) -> DeviceMesh:
    """The mesh gradients are reduced over: dp, or dp x cp flattened when cp > 1.

    cp ranks hold replicated weights but different tokens, so each one's gradient is only its share: they are
    averaged over cp as over dp (FSDP2 / replicate over the flattened dim, the way torchtitan does), and
    ZeRO shards optimizer state over the same ranks.
    """
    dim = data_parallel_dim(grid)
    if dim == DP_CP and not grid.hybrid:
        return mesh["dp", "cp"]._flatten(DP_CP)  # the flattening is cached since init_mesh
    return mesh[dim]


def shard_mesh(mesh: DeviceMesh, grid: Grid) -> DeviceMesh:
    """The mesh ZeRO-2/3 (FSDP2) shard over: ``data_parallel_mesh``, or under hybrid sharding the 2-D
    ``(dp_replicate, dp_shard[_cp])`` mesh, on which ``fully_shard`` shards over the inner dim and replicates over
    the outer (HSDP): all-gathers and reduce-scatters stay inside a shard group, and only each shard's reduced
    gradient is all-reduced across replicas."""
    if not grid.hybrid:
        return data_parallel_mesh(mesh, grid)
    return mesh["dp_replicate", shard_dim(grid)]


def shard_dim(grid: Grid) -> str:
    """The mesh dim ZeRO state is sharded over: ``data_parallel_dim``, or under hybrid sharding ``dp_shard``
    (``dp_shard_cp`` with cp); the replicas then reduce over ``dp_replicate``."""
    if not grid.hybrid:
        return data_parallel_dim(grid)
    return DP_SHARD_CP if grid.cp_enabled else "dp_shard"


def data_parallel_dim(grid: Grid) -> str:
    """The name of the mesh dim gradients are averaged over: ``dp``, or the flattened ``dp_cp`` when cp > 1."""
    return DP_CP if grid.cp_enabled else "dp"
