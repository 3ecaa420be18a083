"""The baseline for ``overhead.py``: the same FSDP2 GPT and steps as a plain ``torchrun`` script.

Only the model definition and the data reader are shared with raymesh; the
loop, sharding and optimizer are written out with plain PyTorch, the way a
user would without a platform. Prints one JSON line from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from workers.data import DataCursor, TokenDataset
from workers.model.config import ModelConfig
from workers.model.gpt import GPT, lm_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, d_ff=4 * args.d_model,
                      seq_len=args.seq_len)
    model = GPT(cfg)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    cursor = DataCursor(TokenDataset(args.data, cfg.seq_len, 0), args.global_batch, rank, world)
    dist.barrier()
    ready = time.time()
    step_times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        inputs, targets = cursor.next_batch()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss.detach())  # the loss the driver would log, as raymesh reports it
        step_times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"ready_unix": ready, "step_time_s": step_times, "world": world, "pid": os.getpid()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
