"""The ``corrupt_checkpoint`` fault: damage the newest complete checkpoint the way a bad disk or copy would.

It flips bytes in the middle of the largest shard file and leaves sizes and
the manifest as they were, so only the checksum can tell (the case DCP alone
would load silently).
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.events import event


def corrupt_newest(ckpt: CheckpointDir) -> Path | None:
    """Flip 16 bytes of the newest complete checkpoint's largest ``.distcp`` file; returns the file (None: none yet)."""
    newest = ckpt.latest()
    shards = sorted(newest.glob("*.distcp"), key=lambda p: p.stat().st_size) if newest is not None else []
    if not shards:
        event("fault_skipped", kind="corrupt_checkpoint", reason="no complete checkpoint on disk yet")
        return None
    target = shards[-1]
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        data = f.read(16)
        f.seek(-len(data), 1)
        f.write(bytes(b ^ 0xFF for b in data))
    event("fault", kind="corrupt_checkpoint", file=target)
    return target
