"""The Hugging Face base a QLoRA run read, pinned beside its checkpoints.

A run with `model.lora.quantize: nf4` and `model.init_from` does not checkpoint its NF4 base (it is rebuilt from
the directory at every start), so `--resume`, `export-hf` and `export-merged` read `init_from` again. If that
directory has been rewritten since (an `export-hf --out` into the same folder), the adapters would sit on another
base without a word. A fresh start records the SHA-256 of the directory's weight files (and config.json) in
`PIN` at the checkpoint directory's root; a resume or an export compares against it and refuses a change.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.errors import SpecError
from workers.data.checksums import file_digest

PIN = "init_from.json"  # {"init_from": DIR, "sha256": {file name: hex digest}}


def pinned(job) -> bool:
    """Whether the job's base is re-read from `model.init_from` rather than restored from its checkpoints."""
    lora = job.model.lora
    return job.model.init_from is not None and lora is not None and lora.quantize == "nf4"


def base_digest(directory: str | Path) -> dict[str, str]:
    """SHA-256 of each file that decides the base's weights: config.json, the safetensors index and shards."""
    root = Path(directory)
    names = sorted(p.name for p in root.iterdir()
                   if p.name == "config.json" or p.name.endswith((".safetensors", ".safetensors.index.json")))
    return {name: file_digest(root / name) for name in names}


def record_base(job, checkpoint_root) -> None:
    """At a fresh start: write `PIN` for a job whose base is re-read (`pinned`)."""
    if not pinned(job):
        return
    checkpoint_root.mkdir(parents=True, exist_ok=True)
    record = {"init_from": job.model.init_from, "sha256": base_digest(job.model.init_from)}
    (checkpoint_root / PIN).write_text(json.dumps(record, indent=2))


def check_base_unchanged(job, checkpoint_root, purpose: str) -> None:
    """Refuse to `purpose` (resume, export) checkpoints under `checkpoint_root` when the `init_from` weights are
    not those `PIN` recorded; checkpoints saved before pins were written have none and pass."""
    pin = checkpoint_root / PIN
    if not pinned(job) or not pin.is_file():
        return
    recorded = json.loads(pin.read_text())["sha256"]
    now = base_digest(job.model.init_from)
    changed = sorted(name for name in recorded.keys() | now.keys() if recorded.get(name) != now.get(name))
    if changed:
        raise SpecError("model.init_from", job.model.init_from,
                        f"is not the base the checkpoints in {checkpoint_root} were trained on ({', '.join(changed)} "
                        f"differ from {pin}); the NF4 base is not checkpointed but re-read from it, so to {purpose} "
                        "would put the adapters on other weights",
                        "restore the directory the run read (its files' SHA-256 are in the pin), or start a fresh "
                        "run in another checkpoint.dir")
