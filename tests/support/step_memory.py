"""Each rank's peak of every live tensor during one training step, without Ray.

Why not the ``memory.measure`` probe (``ActivationMeter.step_peak``): it counts saved activations, parameters,
gradients and optimizer state, so buffers no such tensor holds (ZeRO-0/1's flat gradient copies for their
reduction, the loss backward's gradients) are invisible to it. torch's ``MemTracker`` counts every tensor a CPU
rank allocates, so its peak is the in-step peak the planner's ``RankEstimate.total_bytes`` predicts.

Each rank is a process of the parity harness (``spawn_ranks``) over gloo on loopback; it trains one step first
(so the optimizer state exists, as in every later step) and tracks the second. ``MemTracker`` refuses a module
that runs forward twice in one tracked window, so the jobs measured here take one microbatch a step.
"""

from __future__ import annotations

from orchestrator import JobSpec


def _rank_main(rank: int, specs: list[dict], ports, world_size: int, results) -> None:
    """One spawned rank: for each spec in turn, one step untracked, then one step under ``MemTracker``."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from workers.trainer import Trainer

    torch.set_num_threads(1)
    peaks = []
    for i, spec in enumerate(specs):
        port, listener = ports.join(rank, i)
        trainer = Trainer(spec, rank, world_size, "127.0.0.1", port, listener=listener)
        trainer.train_step()
        tracker = MemTracker()
        tracker.track_external(*trainer.parts.modules, *trainer.state.optimizers)
        with tracker:
            trainer.train_step()
        peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        dist.destroy_process_group()
    results.put((rank, peaks))


def step_peaks(specs: list[JobSpec], timeout_s: float = 120.0) -> list[dict[int, int]]:
    """Per spec (all of one world size, trained on the same spawned ranks): ``{rank: peak bytes of the step}``."""
    from tests.support.parity_harness import rank_ports, spawn_ranks

    world = specs[0].parallel.world_size
    assert all(s.parallel.world_size == world for s in specs), "one spawn trains specs of one world size"
    assert all(s.train.microbatches == 1 for s in specs), "MemTracker tracks one forward per module"
    by_rank = spawn_ranks(_rank_main, ([s.worker_dict() for s in specs], rank_ports(len(specs)), world), world,
                          timeout_s * len(specs))
    return [{rank: peaks[i] for rank, peaks in by_rank.items()} for i in range(len(specs))]
