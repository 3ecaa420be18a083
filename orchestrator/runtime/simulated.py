"""The scale simulator's ``Runtime``: the real controller over virtual ranks, many per Ray actor process.

``SimRuntime`` hands ``TrainingJob`` a ``SimGroup`` of ``workers.loop.virtual.VirtualHost`` actors (each steps a
block of ranks by sleeping ``step_s``), so the controller's loop, its policies, the windows, rank 0's desk and
every Ray call between them run as they do for real ranks, at 16,384 ranks on a two-core machine
(``benchmarks/control_plane.py``). What a virtual rank has no use for is absent: placement (actors reserve no
resources), checkpoints (a job for the simulator saves none) and parameter servers. Fan-out goes to the hosts,
so the controller makes one call per host, not per rank.
"""

from __future__ import annotations

from typing import NoReturn

import ray

from orchestrator.runtime.group import PREEMPTED, StepFailed
from orchestrator.spec import JobSpec
from workers.loop.plan import Request, Window
from workers.loop.virtual import VirtualHost
from workers.protocol import RankInfo


class SimPlacement:
    def release(self) -> None: ...


class NoElastic:
    """The simulator keeps its grid: nothing to grow into, nowhere smaller to go."""

    target_dp = None

    def grow(self, spec: JobSpec, use_gpu: bool) -> None:
        return None

    def shrink_options(self, spec: JobSpec, use_gpu: bool) -> list[JobSpec]:
        return []


class SimRuntime:
    """``hosts`` processes, each stepping ``world / hosts`` virtual ranks that sleep ``step_s`` a step."""

    def __init__(self, hosts: int, step_s: float):
        self.hosts, self.step_s = hosts, step_s
        self.groups: list[SimGroup] = []

    def preflight(self, spec: JobSpec) -> None: ...
    def check_job_faults(self, faults: list[dict], placement) -> None: ...

    def connect(self, address: str | None, needed_cpus: float) -> None:
        if not ray.is_initialized():
            ray.init(address=address, num_cpus=2, log_to_driver=False)

    def available(self) -> tuple[float, float]:
        return float("inf"), 0.0  # a virtual rank reserves nothing

    def reserve(self, spec: JobSpec, use_gpu: bool, timeout_s: float) -> SimPlacement:
        return SimPlacement()

    def start_group(self, spec: JobSpec, placement, use_gpu: bool) -> SimGroup:
        self.groups.append(SimGroup(spec, min(self.hosts, spec.parallel.world_size), self.step_s))
        return self.groups[-1]

    def kill_node_refusal(self, rank: int, node_id: str) -> str | None:
        return "the simulator has no nodes to take down"

    def nodes_gone(self, node_ids) -> set[str]:
        return set()

    def draining(self, node_ids) -> dict[str, float | None]:
        return {}  # virtual hosts have no node of their own to drain

    def elastic(self, spec: JobSpec) -> NoElastic:
        return NoElastic()

    def serve_control(self, job) -> None:
        return None


class SimGroup:
    """The virtual hosts of one grid (what ``group.RankGroupLike`` describes): one call per host per fan-out."""

    def __init__(self, spec: JobSpec, hosts: int, step_s: float):
        self.spec = spec
        self.worker_extra: dict = {}
        world = spec.parallel.world_size
        size = -(-world // hosts)
        self.blocks = [range(lo, min(lo + size, world)) for lo in range(0, world, size)]
        cls = ray.remote(concurrency_groups={"control": 2, "mail": 1})(VirtualHost)
        self.hosts = [cls.options(num_cpus=0).remote(i, block, step_s) for i, block in enumerate(self.blocks)]
        ray.get([h.connect.remote(self.hosts) for h in self.hosts])
        self._loops: list = []
        self._window_id, self._cursor = 0, 0
        self.died_at: float | None = None

    def form(self) -> list[RankInfo]:
        """Every host forms its ranks again (step 0, no mail); the controller's view of each rank."""
        ray.get([h.form.remote() for h in self.hosts])
        grid = self.spec.parallel.grid
        return [RankInfo(rank=r, coords=grid.coords_dict(r), stages=[0], device="cpu", device_name="virtual",
                         pid=host, node_id=f"host{host}", actor_id=f"host{host}")
                for host, block in enumerate(self.blocks) for r in block]

    def start_window(self, window: Window, window_id: int) -> None:
        self._window_id, self._cursor = window_id, 0
        self._loops = [h.run_window.remote(window, window_id) for h in self.hosts]

    def window_items(self, wait_s: float) -> list:
        items, self._cursor = ray.get(self.hosts[0].desk_items.remote(self._window_id, self._cursor, wait_s))
        if items:
            return items
        ready, _ = ray.wait([self._loops[0]], timeout=0)
        if ready:  # host 0's loop is over with nothing left on its desk: the window failed
            self.window_failed()
        return []

    def post(self, request: Request) -> int | None:
        return ray.get(self.hosts[0].desk_post.remote(self._window_id, request))

    def window_failed(self) -> None:
        """The ranks that died, from every host's account of the window (one call per host)."""
        ray.wait(self._loops, num_returns=len(self._loops), timeout=30)
        outcomes = ray.get([h.window_outcome.remote() for h in self.hosts])
        dead = {r: how for outcome in outcomes for r, how in outcome.items() if how != "peer_lost"}
        self.died_at = min((t for t in ray.get([h.died_at.remote() for h in self.hosts]) if t is not None),
                           default=None)  # when the first rank was killed (one machine, one clock): the benchmark's
        raise StepFailed(dead or {0: "hung"})

    def window_hung(self, silent_s: float) -> None:
        """Virtual ranks do not hang (a host's loop sleeps a set time): what failed the window is asked as usual."""
        self.window_failed()

    def preempted(self, ranks, leave: tuple[str, ...] = ()) -> NoReturn:
        """Virtual ranks have no process to be told to go: never called (no rank's summary carries a notice)."""
        raise StepFailed(dict.fromkeys(ranks, PREEMPTED))

    def finish_failed_step(self) -> dict[int, str]:
        return {}

    def replace(self, ranks) -> None: ...  # a dead virtual rank steps again once its host forms again
    def start_spares(self) -> None: ...

    def placed(self, ranks, timeout_s: float) -> bool:
        return True

    def snapshot(self, keep_from: int = -1) -> None:
        ray.get([h.take_snapshot.remote(keep_from) for h in self.hosts])

    def restore(self, replaced: set[int], up_to: int) -> int:
        """Every host to the newest snapshot step all of them hold, at most ``up_to`` (no state: no time)."""
        held = ray.get([h.snapshot_steps.remote() for h in self.hosts])
        common = set.intersection(*(set(steps) for steps in held)) if held else set()
        steps = [s for s in common if s <= up_to]
        if not steps:
            raise LookupError(f"no snapshot step up to {up_to} is held by every virtual host")
        return ray.get([h.restore.remote(max(steps)) for h in self.hosts])[0]

    def survivor_snapshots(self, dead: set[int], up_to: int) -> None:
        return None

    def restore_positions(self, step: int, kept: dict) -> int:
        raise NotImplementedError("the simulator keeps its grid")

    def call(self, method: str, *args) -> list:
        """The between-window calls a job without checkpoints makes: nothing to save, wait for or load."""
        if method in ("save_checkpoint", "wait_checkpoint"):
            return [None] * self.spec.parallel.world_size
        raise NotImplementedError(f"virtual ranks do not {method}: run the simulator without checkpoints")

    def stop(self) -> None:
        for h in self.hosts:
            ray.kill(h)
