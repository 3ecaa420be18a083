"""Peak host memory of each rank while it builds its share of the model (``build_parts``), without Ray.

Each rank is a process of the parity harness (``spawn_ranks``) over gloo on loopback. It resets its
RSS high-water mark (``/proc/self/clear_refs``), builds, and reports how far ``VmHWM`` rose above the RSS it
had before, beside the bytes of parameters it holds and the largest single full parameter.

Run it directly for the figures (``--layout`` as JSON, e.g. '{"dp": 4, "zero": 3}'):
``PYTHONPATH=$PWD python -m tests.support.startup_memory``. It imports only ``build_parts`` and its
inputs, so the same file measures an older tree too (``PYTHONPATH=/path/to/old/tree``).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

MiB = 2**20
# ~151 MB of fp32 weights in 12 blocks; the largest tensor (w1/w2, 512 x 2048) is 4 MiB
MODEL = {"d_model": 512, "n_layers": 12, "n_heads": 8, "d_ff": 2048, "seq_len": 32, "vocab_size": 256}


@dataclass(frozen=True)
class RankMemory:
    rank: int
    rise_bytes: int  # VmHWM after the build minus VmRSS before it
    held_bytes: int  # this rank's local parameter bytes
    largest_bytes: int  # the largest single full parameter, in bytes
    full_bytes: int  # the whole model's parameter bytes


def _status_kib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _rank_main(rank: int, spec: dict, world_size: int, ports, results) -> None:
    import torch.distributed as dist

    from workers.model.registry import build_model
    from workers.parallel.parallelize import build_parts
    from workers.parallel.process_group import init_mesh
    from workers.spec import WorkerSpec

    torch.set_num_threads(1)
    ws = WorkerSpec.from_dict(spec)
    port, listener = ports.join(rank, 0)
    mesh = init_mesh(rank, world_size, "127.0.0.1", port, ws.parallel.grid, torch.device("cpu"), listener=listener)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before = _status_kib("VmRSS")
    parts = build_parts(ws, mesh, torch.device("cpu"))
    rise = (_status_kib("VmHWM") - before) * 1024
    params = [p for m in parts.modules for p in m.parameters()]
    held = sum(_local(p).numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)  # a DTensor's numel is its full size
    with torch.device("meta"):
        full = sum(p.numel() * 4 for p in build_model(ws.model).parameters())
    results.put((rank, RankMemory(rank, rise, held, largest, full)))
    dist.barrier()
    dist.destroy_process_group()


def measure(layout: dict, model: dict | None = None, timeout_s: float = 240.0) -> list[RankMemory]:
    """Every rank's start-up memory for ``layout`` (parallel fields) on ``model`` (default ``MODEL``)."""
    from tests.support.jobs import tiny_spec
    from tests.support.parity_harness import rank_ports, spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        job = tiny_spec(Path(tmp), Path(tmp), model=model or MODEL, parallel={**layout, "device": "cpu"})
        spec, world = job.worker_dict(), job.parallel.grid.world_size
        by_rank = spawn_ranks(_rank_main, (spec, world, rank_ports(1)), world, timeout_s)
    return [by_rank[rank] for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default='{"dp": 4, "zero": 3}')
    args = parser.parse_args()
    for r in measure(json.loads(args.layout)):
        print(f"rank {r.rank}: VmHWM rise {r.rise_bytes / MiB:.1f} MiB; holds {r.held_bytes / MiB:.1f} MiB, "
              f"largest tensor {r.largest_bytes / MiB:.1f} MiB, full model {r.full_bytes / MiB:.1f} MiB")


if __name__ == "__main__":
    main()
