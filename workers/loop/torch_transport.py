"""The exchange tree's messages between real ranks: pickled objects over a gloo process group of every rank.

A group of its own (``dist.new_group(backend="gloo")``), so the few small messages of each boundary never
interleave with training's collectives, and on GPUs they stay on the host (a gloo group on CPU tensors).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class TorchTransport:
    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def send(self, obj: Any, to: int) -> None:
        dist.send_object_list([obj], dst=to, group=self.group)

    def recv(self, source: int) -> Any:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=source, group=self.group)
        return box[0]
