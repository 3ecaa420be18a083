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
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from orchestrator.checkpoints import checksums


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

    def field(self, name: str) -> dict[int, list]:
        """One field of every rank's step results: ``{rank: [value per step]}``."""
        return {rank: [step.get(name) for step in steps] for rank, steps in (self.results or {}).items()}


def free_port() -> int:
    """A loopback port nobody listens on right now (the rendezvous store binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, spec: dict, world_size: int, port: int, steps: int, checkpoint: str | None,
               resume: str | None, save_after: int | None, results) -> None:
    """Body of one spawned rank: build the Trainer (and load the DCP checkpoint ``resume`` when given; DCP
    reshards it to this layout), train ``steps`` steps, report each step's result dict, and save the
    state after ``save_after`` steps (default: the last) to ``checkpoint`` when given."""
    import torch.distributed as dist

    from workers.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(spec, rank, world_size, "127.0.0.1", port)
    if resume is not None:
        trainer.checkpoints.load(resume)
    out = []
    for step in range(1, steps + 1):
        result = trainer.train_step()
        out.append(result.to_dict())  # a workers.protocol.StepResult, sent as the JSON form the records use
        if checkpoint is not None and step == (save_after or steps):
            trainer.checkpoints.save(checkpoint, async_save=False)
    results.put((rank, out))
    dist.destroy_process_group()


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
               checkpoint: str | None = None, resume: str | None = None, save_after: int | None = None) -> LayoutRun:
    """Train ``spec`` (a worker spec dict) on ``world_size`` spawned ranks; return what the controller would record.
    With ``checkpoint``, the ranks save their state there after ``save_after`` steps (default: their final state;
    a DCP checkpoint written by this layout); with ``resume``, they first load that checkpoint (written by any
    layout: DCP reshards it) and go on from its step.
    """
    port = free_port()
    by_rank = spawn_ranks(_rank_main, (spec, world_size, port, steps, checkpoint, resume, save_after),
                          world_size, timeout_s)
    if checkpoint is not None:  # sealed as the controller seals a save, so export/--resume accept it
        checksums.write_manifest(checkpoint)
    return _as_controller_sees(by_rank, steps)


def spawn_ranks(body, args: tuple, world_size: int, timeout_s: float) -> dict:
    """Run ``body(rank, *args, results)`` in ``world_size`` spawn children; return ``{rank: what it put}``.

    Each child puts one ``(rank, value)`` on ``results``. A rank that dies raises here at once, ranks still
    alive after a failure or the timeout are killed. OMP_NUM_THREADS=1 is set for the children (they inherit
    the environment at spawn): N ranks each starting a full thread pool on a small CI machine is slower than
    one thread each.
    """
    results = mp.get_context("spawn").Queue()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = mp.start_processes(body, args=(*args, results), nprocs=world_size, join=False,
                                   start_method="spawn")
        try:
            by_rank = _collect(results, procs, world_size, timeout_s)
            _join_all(procs, timeout_s)
        finally:
            _stop_leftovers(procs)
    finally:
        _restore_env("OMP_NUM_THREADS", old)
    return by_rank


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


def _as_controller_sees(by_rank: dict[int, list[dict]], steps: int) -> LayoutRun:
    """Per step: the mean loss of the ranks that hold the last stage, and rank 0's global gradient norm."""
    losses = []
    for step in range(steps):
        held = [by_rank[r][step]["loss"] for r in sorted(by_rank) if by_rank[r][step]["loss"] is not None]
        losses.append(statistics.fmean(held))  # as orchestrator/observability/run_records.py
    return LayoutRun(losses, [by_rank[0][step]["grad_norm"] for step in range(steps)], by_rank)
