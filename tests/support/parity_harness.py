"""Run one parallel layout's ranks as plain processes over gloo on loopback: the layout's math without Ray.

Why: a parity test through Ray pays for actors, placement and the controller on every layout, although
what it checks (the parallel wrappers, the schedules, the sharded optimizer) all lives in
``workers.trainer.Trainer``. Here each rank is a ``torch.multiprocessing`` child (forked from the fork
server, ``spawn_ranks``) that builds the Trainer exactly as ``RankWorker.setup`` does and sends its per-step
results back through a queue; the Ray path keeps one parity test per axis to cover what only it adds.
"""

from __future__ import annotations

import os
import queue
import statistics
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from orchestrator.checkpoints import checksums
from orchestrator.planning.stage_split import pin_split
from orchestrator.spec import JobSpec
from tests.support.environ import kept_env
from tests.support.ports import GroupPorts


@dataclass(frozen=True)
class LayoutRun:
    """What the controller would have recorded: per-step loss (mean over last-stage ranks) and global norm;
    and every rank's step results as dicts (``results[rank][step]``: times, memory, comm_bytes, timeline...)."""

    losses: list[float]
    grad_norms: list[float]
    results: dict[int, list[dict]] | None = None

    @property
    def memory(self) -> dict[int, dict | None]:
        """Rank -> its last step's memory record (``memory.measure``; None where it is off)."""
        return {rank: steps[-1].get("memory") for rank, steps in (self.results or {}).items() if steps}

    @property
    def activation_bytes(self) -> dict[int, int]:
        """Rank -> its last step's activation peak, for the ranks that measured one."""
        return {rank: record["activations"] for rank, record in self.memory.items() if record}

    @property
    def step_s(self) -> list[float]:
        """Per step, the slowest rank's step time (what the benchmarks compare)."""
        steps = len(self.losses)
        return [max(out[i]["time_s"]["step"] for out in (self.results or {}).values()) for i in range(steps)]

    @property
    def eval_losses(self) -> dict[int, float]:
        """Step -> the held-out loss the controller would record (the mean over the ranks that report one, as
        ``orchestrator/observability/run_records.py``), for the steps that evaluated."""
        out = {}
        for steps in zip(*(self.results or {}).values()):
            held = [r["eval_loss"] for r in steps if r.get("eval_loss") is not None]
            if held:
                out[steps[0]["step"]] = statistics.fmean(held)
        return out

    def field(self, name: str) -> dict[int, list]:
        """One field of every rank's step results: ``{rank: [value per step]}``."""
        return {rank: [step.get(name) for step in steps] for rank, steps in (self.results or {}).items()}


@dataclass(frozen=True)
class Job:
    """One spec a spawned group trains: for how many steps, where it starts from and where (after how many steps)
    it saves."""

    spec: dict
    steps: int
    checkpoint: str | None = None
    resume: str | None = None
    save_after: int | None = None


def _rank_main(rank: int, jobs: list[Job], ports: GroupPorts, world_size: int, results) -> None:
    """Body of one spawned rank: for each job in turn, build the Trainer (and load the DCP checkpoint
    ``resume`` when given; DCP reshards it to this layout), train its ``steps`` steps keeping each step's result
    dict, and save the state after ``save_after`` steps (default: the last) to ``checkpoint`` when given;
    report them all at the end."""
    import torch.distributed as dist

    from workers.trainer import Trainer

    torch.set_num_threads(1)
    outs = []
    for i, job in enumerate(jobs):
        port, listener = ports.join(rank, i)
        trainer = Trainer(job.spec, rank, world_size, "127.0.0.1", port, listener=listener)
        if job.resume is not None:
            trainer.checkpoints.load(job.resume)
        if job.checkpoint is not None and job.save_after == 0:  # the state as loaded (resharded), before any step
            trainer.checkpoints.save(job.checkpoint, async_save=False)
        out = []
        for step in range(1, job.steps + 1):
            out.append(trainer.train_step().to_dict())  # the JSON form the records use
            if job.checkpoint is not None and step == (job.steps if job.save_after is None else job.save_after):
                trainer.checkpoints.save(job.checkpoint, async_save=False)
        outs.append(out)
        dist.destroy_process_group()
    results.put((rank, outs))


def _collect(results, procs, world_size: int, timeout_s: float) -> dict[int, list]:
    """Every rank's results; a rank that dies raises here at once (``join`` re-raises its traceback),
    instead of its peers waiting out the collective timeout."""
    by_rank, deadline = {}, time.monotonic() + timeout_s
    while len(by_rank) < world_size:
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(by_rank))} sent nothing in {timeout_s}s")
        try:
            rank, out = results.get(timeout=0.5)
            by_rank[rank] = out
        except queue.Empty:
            procs.join(timeout=0)
    return by_rank


def run_layout(spec: dict, world_size: int, steps: int, timeout_s: float = 300.0,
               checkpoint: str | None = None, resume: str | None = None, save_after: int | None = None) -> LayoutRun:
    """Train ``spec`` (a worker spec dict) on ``world_size`` spawned ranks; return what the controller would record.
    With ``checkpoint``, the ranks save their state there after ``save_after`` steps (default: their final state;
    0: the state as loaded, before any step; a DCP checkpoint written by this layout); with ``resume``, they first
    load that checkpoint (written by any layout: DCP reshards it) and go on from its step."""
    return run_layouts([spec], world_size, steps, timeout_s, [checkpoint], [resume], [save_after])[0]


def resumed_mid_run(spec_of, tmp_path, world_size: int, steps: int = 4, at: int = 2,
                    timeout_s: float = 600.0) -> tuple[LayoutRun, LayoutRun]:
    """A straight run of ``steps`` that saves after ``at``, and a run resumed from that save for the rest:
    ``spec_of(run_dir, steps)`` gives each one's worker spec dict. A test compares the resumed run's steps with
    the straight run's last ones."""
    saved = str(tmp_path / f"step{at}")
    straight = run_layout(spec_of(tmp_path / "s", steps), world_size, steps, checkpoint=saved, save_after=at,
                          timeout_s=timeout_s)
    resumed = run_layout(spec_of(tmp_path / "r", steps - at), world_size, steps - at, resume=saved,
                         timeout_s=timeout_s)
    return straight, resumed


def run_spec(spec: JobSpec, timeout_s: float = 300.0, checkpoint: str | None = None) -> LayoutRun:
    """Train ``spec`` for its ``train.steps`` on its own world size of ranks (``run_layout``): e.g. the uninterrupted
    run a recovery test compares a Ray job with, bit for bit (the same Trainer, no controller decision in it).
    A ``parallel.pp_split: auto`` is pinned first, as the controller pins it before any rank starts."""
    return run_layout(pin_split(spec).worker_dict(), spec.parallel.world_size, spec.train.steps, timeout_s, checkpoint)


def run_layouts(specs: list[dict], world_size: int, steps: int | list[int], timeout_s: float = 300.0,
                checkpoints: list[str | None] | None = None, resumes: list[str | None] | None = None,
                save_afters: list[int | None] | None = None) -> list[LayoutRun]:
    """Train each of ``specs`` in turn on the same ``world_size`` spawned ranks (so several small jobs pay for
    spawning and importing torch once); one ``LayoutRun`` per spec. ``steps``: for every spec, or one count per
    spec. ``checkpoints``/``resumes``/``save_afters``: per spec, as ``run_layout`` takes them (a later spec may
    resume an earlier one's save)."""
    n = len(specs)
    counts = [steps] * n if isinstance(steps, int) else steps
    jobs = [Job(spec, k, c, r, s) for spec, k, c, r, s in
            zip(specs, counts, checkpoints or [None] * n, resumes or [None] * n, save_afters or [None] * n,
                strict=True)]
    by_rank = spawn_ranks(_rank_main, (jobs, rank_ports(n), world_size), world_size, timeout_s * n)
    for job in jobs:  # sealed as the controller seals a save, so export/--resume accept it
        if job.checkpoint is not None:
            checksums.write_manifest(job.checkpoint)
    return [_as_controller_sees({rank: outs[i] for rank, outs in by_rank.items()}, job.steps)
            for i, job in enumerate(jobs)]


def run_grouped(specs: dict[str, JobSpec], timeout_s: float = 300.0,
                checkpoints: dict[str, str] | None = None) -> dict[str, LayoutRun | Exception]:
    """Train every spec of ``specs`` for its ``train.steps``: those of one world size in one spawn
    (``run_layouts``). Why: spawning the ranks and importing torch is most of a tiny layout's time (7.5 s of 7.8 s
    for 4 ranks and 10 steps on this 2-core machine; three layouts took 8.5 s in one spawn, 22.8 s in three), so a
    module's layouts share it. A group that fails runs again one spec at a time, so each spec's entry is its own
    ``LayoutRun`` or the error its own run raised, and a test fails for its own layout only. ``checkpoints``: where
    a spec's ranks save their final state (as ``run_layout``'s ``checkpoint``). A ``pp_split: auto`` is pinned
    first, as the controller pins it."""
    specs = {name: pin_split(spec) for name, spec in specs.items()}
    groups: dict[int, list[str]] = {}
    for name, spec in specs.items():
        groups.setdefault(spec.parallel.world_size, []).append(name)
    saves = checkpoints or {}
    out: dict[str, LayoutRun | Exception] = {}
    for world, names in groups.items():
        try:
            out.update(zip(names, run_layouts([specs[n].worker_dict() for n in names], world,
                                              [specs[n].train.steps for n in names], timeout_s,
                                              [saves.get(n) for n in names])))
        except Exception as exc:
            if len(names) == 1:
                out[names[0]] = exc
            else:
                out.update({n: _alone(specs[n], timeout_s, saves.get(n)) for n in names})
    return out


def ran(runs: dict[str, LayoutRun | Exception], name: str) -> LayoutRun:
    """``name``'s run from ``run_grouped``, or the error its run raised, raised here (in its own test)."""
    run = runs[name]
    if isinstance(run, Exception):
        raise run
    return run


def _alone(spec: JobSpec, timeout_s: float, checkpoint: str | None) -> LayoutRun | Exception:
    """``spec`` trained in a spawn of its own: its run, or the error it raised."""
    try:
        return run_spec(spec, timeout_s, checkpoint)
    except Exception as exc:
        return exc


# Ranks are forked from Python's fork server, which imports these once, not spawned fresh: each rank then starts
# with torch, DTensor and the Trainer already imported (~4.5 s of CPU a rank on a 2-core machine, most of a tiny
# layout's cost). The server imports only and runs no torch op; the one thread the imports start is pyarrow's
# jemalloc background purger, which jemalloc's own fork handlers reset in the child. It lives as long as the test
# process, started on first use with OMP_NUM_THREADS=1 set.
PRELOAD = ["workers.trainer"]


def _rank_context():
    """The multiprocessing context ranks start from: the fork server, preloading ``PRELOAD`` (a no-op once it
    runs)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def rank_ports(groups: int) -> GroupPorts:
    """Ports for ``groups`` gloo groups that ranks of ``spawn_ranks`` form one after another (``GroupPorts``)."""
    return GroupPorts(groups, _rank_context())


def gloo_dp_mesh(rank: int, ports: GroupPorts, world_size: int):
    """Inside a ``spawn_ranks`` child: join the ranks' gloo group on loopback (one thread each) and return the 1-D
    ``dp`` mesh over all of them, what a test of one data-parallel collective needs."""
    from torch.distributed.device_mesh import init_device_mesh

    from workers.parallel.process_group import join_on_loopback

    torch.set_num_threads(1)
    port, listener = ports.join(rank, 0)
    join_on_loopback(rank, world_size, port, listener=listener)
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))


def spawn_ranks(body, args: tuple, world_size: int, timeout_s: float) -> dict:
    """Run ``body(rank, *args, results)`` in ``world_size`` child processes (forked from the fork server,
    ``_rank_context``); return ``{rank: what it put}``.

    Each child puts one ``(rank, value)`` on ``results``. A rank that dies raises here at once, ranks still
    alive after a failure or the timeout are killed. OMP_NUM_THREADS=1 is set for the children (and the fork
    server, started by the first call): N ranks each starting a full thread pool on a small CI machine is
    slower than one thread each.
    """
    ctx = _rank_context()
    results = ctx.Queue()
    with kept_env("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = "1"
        procs = mp.start_processes(_as_spawned, args=(body, dict(os.environ), *args, results),
                                   nprocs=world_size, join=False, start_method="forkserver")
        try:
            by_rank = _collect(results, procs, world_size, timeout_s)
            _join_all(procs, timeout_s)
        finally:
            _stop_leftovers(procs)
    return by_rank


def _as_spawned(rank: int, body, env: dict, *args) -> None:
    """Run ``body(rank, *args)`` in the caller's environment, as a spawned child would: a fork of the server has
    the server's, from its first start (a test's S3 credentials, or a variable a test set for its ranks, would be
    missing). ``sys.path`` and the working directory multiprocessing already sends with every start."""
    os.environ.clear()
    os.environ.update(env)
    body(rank, *args)


def _join_all(procs, timeout_s: float) -> None:
    """Wait for every rank to exit (``join`` returns as soon as one does, and re-raises a rank's error)."""
    deadline = time.monotonic() + timeout_s
    while not procs.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            return


def _stop_leftovers(procs) -> None:
    """Kill ranks still alive after a failure or timeout, so one broken layout leaves no orphans behind."""
    for proc in procs.processes:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _as_controller_sees(by_rank: dict[int, list[dict]], steps: int) -> LayoutRun:
    """Per step: the mean loss of the ranks that hold the last stage, and rank 0's global gradient norm."""
    losses = []
    for step in range(steps):
        held = [by_rank[r][step]["loss"] for r in sorted(by_rank) if by_rank[r][step]["loss"] is not None]
        losses.append(statistics.fmean(held))  # as orchestrator/observability/run_records.py
    return LayoutRun(losses, [by_rank[0][step]["grad_norm"] for step in range(steps)], by_rank)
