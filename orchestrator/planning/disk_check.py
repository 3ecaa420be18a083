"""Will the NVMe offload files fit? Checked before any actor starts, like the data path.

A rank's store takes what the planner moves off its device (``planner.estimate``'s
``state.offloaded``: Adam's moments, an fp32 master where the device needs one,
parameter shards under parameter offload; and ``offloaded_activation_bytes``, the
saved tensors activation offload packs away, halved for bf16 compression,
quartered for fp8), so the check and `raymesh plan` cannot disagree. Every rank is counted against the one path,
the worst case of all ranks sharing a node. (Ranks on other nodes write to
their own disks; this checks the driver's.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from orchestrator.errors import SpecError
from orchestrator.planning.estimate import estimate
from orchestrator.spec import JobSpec

ACTIVATION_SCALE = {"none": 1.0, "bf16": 0.5, "fp8": 0.25}


def offload_bytes(spec: JobSpec) -> int:
    """Bytes all ranks' NVMe stores may hold at once (0 unless tier is nvme)."""
    if spec.memory.offload.tier != "nvme":
        return 0
    scale = ACTIVATION_SCALE[spec.memory.activation_compression]
    return sum(row.state.offloaded + int(row.offloaded_activation_bytes * scale) for row in estimate(spec))


def check_offload_space(spec: JobSpec) -> None:
    need = offload_bytes(spec)
    if not need:
        return
    path = Path(spec.memory.offload.path)
    existing = next(p for p in (path, *path.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if need > free:
        raise SpecError(
            "memory.offload.path", str(path),
            f"has {free / 2**30:.2f} GiB free on its disk but the offload stores need about {need / 2**30:.2f} GiB "
            f"({spec.parallel.world_size} ranks)",
            "point memory.offload.path at a drive with more space, use memory.offload.tier: cpu, offload less "
            "(memory.offload.*), or shard more (parallel.zero: 3 with a larger parallel.dp)",
        )
