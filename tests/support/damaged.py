"""Inputs with something wrong in them, built small and Ray-free for the integrity tests: a job file over prepared
text with a sealed checkpoint, pickles that would run code, a Hugging Face directory to damage."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

TEXT = "def f(x):\n    return x * 2\n\n\nclass A:\n    pass\n" * 40


class RunsCode:
    """Pickles as a call to ``os.mkdir(marker)``: unpickled, it leaves a directory behind (what a planted
    payload would do, harmlessly)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def payload(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when it is loaded."""
    return pickle.dumps(RunsCode(marker))


def tiny_job(root: Path, model: str = "  seq_len: 16\n  d_model: 32\n  n_layers: 1\n  n_heads: 2\n  d_ff: 64\n",
             tokenizer: str = "bytes") -> Path:
    """A job file over a few thousand bytes of prepared text (``root/data``), run dir ``root/run``."""
    from workers.data.prepare import prepare_data

    (root / "src").mkdir(parents=True, exist_ok=True)
    (root / "src" / "a.py").write_text(TEXT)
    prepare_data([root / "src"], root / "data", tokenizer=tokenizer)
    job = root / "job.yaml"
    job.write_text(f"data:\n  path: {root / 'data'}\nmodel:\n{model}run_dir: {root / 'run'}\n")
    return job


def sealed_checkpoint(job: Path, step: int = 1, extra: dict | None = None) -> Path:
    """The job's model, as the job builds it, saved as DCP step ``step`` in its checkpoint dir (with ``extra``
    entries beside ``model``) and sealed with raymesh's checksum manifest."""
    from orchestrator.checkpoints.checksums import write_manifest
    from orchestrator.spec import load_spec
    from workers.model.meta_init import build_full
    from workers.spec import WorkerSpec

    spec = load_spec(str(job), [])
    worker = WorkerSpec.from_dict(spec.worker_dict())
    model = build_full(worker.model, worker.train.seed)
    path = spec.checkpoint_dir() / f"step-{step:08d}"
    save_dcp({"model": model.state_dict(), **(extra or {})}, path)
    write_manifest(path)
    return path


def save_dcp(state: dict, path: Path) -> None:
    """``dcp.save`` in this process alone."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves without a process group
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def reseal(path: Path) -> None:
    """What anyone who can write a checkpoint can do: write its checksum manifest again over changed files."""
    from orchestrator.checkpoints.checksums import write_manifest

    write_manifest(path)


def flip_byte(path: Path, at: int) -> None:
    """Invert the byte at offset ``at`` (negative: from the end) of ``path``."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))

