"""Run one parallel layout's ranks as plain processes over gloo on loopback: the layout's math without Ray.

Why: a parity test through Ray pays for actors, placement and the controller on every layout, although
what it checks (the parallel wrappers, the schedules, the sharded optimizer) all lives in
``workers.trainer.Trainer``. Here each rank is a ``torch.multiprocessing`` spawn child that builds the
Trainer exactly as ``RankWorker.setup`` does and sends its per-step results back through a queue; the
Ray path keeps one parity test per axis to cover what only it adds.
"""

from __future__ import annotations

import os
import queue
import socket
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from orchestrator.checkpoints import checksums


@dataclass(frozen=True)
class LayoutRun:
    """What the controller would have recorded: per-step loss (mean over last-stage ranks) and global norm."""

    losses: list[float]
    grad_norms: list[float]
    step_s: list[float] = field(default_factory=list)  # per step, the slowest rank's step time (benchmarks)


def step_field(result, name: str):
    """One field of a rank's step result, whichever form ``Trainer.train_step`` returns.

    The trainer is moving from returning a plain dict to returning a frozen ``workers.protocol.StepResult``;
    reading through this one helper keeps the harness working on both sides of that change.
    """
    return result[name] if isinstance(result, dict) else getattr(result, name)


def free_port() -> int:
    """A loopback port nobody listens on right now (the rendezvous store binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, specs: list[dict], world_size: int, ports: list[int], steps: int, results,
               checkpoints: list[str | None], resumes: list[str | None]) -> None:
    """Body of one spawned rank: for each spec in turn, build the Trainer (from the DCP checkpoint in
    ``resumes`` when given), train ``steps`` steps and keep (loss, norm) per step, and save a DCP checkpoint of
    the final state to its entry in ``checkpoints`` when given; report them all at the end."""
    import torch.distributed as dist

    from workers.trainer import Trainer

    torch.set_num_threads(1)
    outs = []
    for spec, port, checkpoint, resume in zip(specs, ports, checkpoints, resumes, strict=True):
        trainer = Trainer(spec, rank, world_size, "127.0.0.1", port)
        if resume is not None:
            trainer.checkpoints.load(resume)
        out = []
        for _ in range(steps):
            result = trainer.train_step()
            out.append((step_field(result, "loss"), step_field(result, "grad_norm"), _step_seconds(result)))
        if checkpoint is not None:
            trainer.checkpoints.save(checkpoint, async_save=False)
        outs.append(out)
        dist.destroy_process_group()
    results.put((rank, outs))


def _step_seconds(result) -> float:
    """The step's wall time from a typed result (0.0 from the older dict form, which has none)."""
    times = step_field(result, "time_s") if not isinstance(result, dict) else None
    return float(times.step) if times is not None else 0.0


def _collect(results, procs, world_size: int, timeout_s: float) -> dict[int, list[tuple]]:
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
               checkpoint: str | None = None, resume: str | None = None) -> LayoutRun:
    """Train ``spec`` (a worker spec dict) on ``world_size`` spawned ranks; return what the controller would record.
    With ``checkpoint``, the ranks save their final state there (a DCP checkpoint written by this layout); with
    ``resume``, they start from that DCP checkpoint (written by any layout: DCP reshards)."""
    return run_layouts([spec], world_size, steps, timeout_s, [checkpoint], [resume])[0]


def run_layouts(specs: list[dict], world_size: int, steps: int, timeout_s: float = 300.0,
                checkpoints: list[str | None] | None = None, resumes: list[str | None] | None = None,
                ) -> list[LayoutRun]:
    """Train each of ``specs`` in turn on the same ``world_size`` spawned ranks (so several small jobs pay for
    spawning and importing torch once); one ``LayoutRun`` per spec. ``checkpoints``/``resumes``: per spec, where
    to save its final state and which checkpoint to start from (a later spec may resume an earlier one's save).

    OMP_NUM_THREADS=1 is set for the children (they inherit the environment at spawn): N ranks each
    starting a full thread pool on a small CI machine is slower than one thread each.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    ports = [free_port() for _ in specs]
    checkpoints, resumes = checkpoints or [None] * len(specs), resumes or [None] * len(specs)
    try:
        procs = mp.start_processes(_rank_main, args=(specs, world_size, ports, steps, results, checkpoints, resumes),
                                   nprocs=world_size, join=False, start_method="spawn")
        try:
            by_rank = _collect(results, procs, world_size, timeout_s * len(specs))
            _join_all(procs, timeout_s)
        finally:
            _stop_leftovers(procs)
    finally:
        _restore_env("OMP_NUM_THREADS", old)
    for checkpoint in checkpoints:  # sealed as the controller seals a save, so export/--resume accept it
        if checkpoint is not None:
            checksums.write_manifest(checkpoint)
    return [_as_controller_sees({rank: outs[i] for rank, outs in by_rank.items()}, steps) for i in range(len(specs))]


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


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _as_controller_sees(by_rank: dict[int, list[tuple]], steps: int) -> LayoutRun:
    """Per step: the mean loss of the ranks that hold the last stage, and rank 0's global gradient norm."""
    losses = []
    for step in range(steps):
        held = [by_rank[r][step][0] for r in sorted(by_rank) if by_rank[r][step][0] is not None]
        losses.append(statistics.fmean(held))  # as orchestrator/observability/run_records.py
    slowest = [max(out[step][2] if len(out[step]) > 2 else 0.0 for out in by_rank.values()) for step in range(steps)]
    return LayoutRun(losses, [by_rank[0][step][1] for step in range(steps)], slowest)
