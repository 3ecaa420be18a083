"""QLoRA from `model.init_from` re-reads its NF4 base at resume and export: the base is pinned at a fresh start and a
rewritten directory is refused, naming the field and the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator import JobSpec
from orchestrator.checkpoints import checksums
from orchestrator.checkpoints.base_pin import PIN, check_base_unchanged, record_base
from orchestrator.errors import SpecError
from orchestrator.runtime.controller import TrainingJob
from orchestrator.spec.lora import checkpoint_to_read
from tests.support.hf import save_hf_llama

REFUSED = (r"model.init_from`: value .* is not the base the checkpoints in .* were trained on "
           r"\(model.safetensors differ .*\); the NF4 base is not checkpointed.*fix: restore the directory")


def _job(src, tmp_path, quantize: str | None = "nf4") -> JobSpec:
    return JobSpec.from_dict({"data": {"path": str(tmp_path / "data")}, "run_dir": str(tmp_path / "run"),
                              "model": {"init_from": str(src), "lora": {"rank": 4, "quantize": quantize}}})


def _checkpoint(job) -> None:
    """A sealed (checksummed) step directory in the job's checkpoint dir: what the export reads."""
    step = job.checkpoint_dir() / "step-00000001"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"dcp")
    checksums.write_manifest(step)


def test_a_rewritten_base_is_refused_at_resume_and_export(tmp_path):
    src = save_hf_llama(tmp_path / "hf", seed=0)
    job = _job(src, tmp_path)
    start = SimpleNamespace(spec=job, ckpt=SimpleNamespace(root=job.checkpoint_dir()), resume=False)
    TrainingJob._pin_base(start)  # the fresh start pins it
    assert (job.checkpoint_dir() / PIN).is_file()
    _checkpoint(job)
    TrainingJob._pin_base(SimpleNamespace(**{**vars(start), "resume": True}))  # unchanged: resumes
    assert checkpoint_to_read(job, None, "export").name == "step-00000001"
    save_hf_llama(src, seed=1)  # same shape, other weights, same place
    with pytest.raises(SpecError, match=REFUSED.replace("checkpointed", "checkpointed.* so to resume")):
        TrainingJob._pin_base(SimpleNamespace(**{**vars(start), "resume": True}))
    with pytest.raises(SpecError, match=REFUSED):
        checkpoint_to_read(job, None, "export")


def test_only_a_base_that_is_not_checkpointed_is_pinned(tmp_path):
    """Plain LoRA checkpoints its frozen base, so it is not pinned; a run saved before pins existed passes."""
    src = save_hf_llama(tmp_path / "hf")
    record_base(_job(src, tmp_path, quantize=None), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / PIN).exists()
    check_base_unchanged(_job(src, tmp_path), tmp_path / "ckpt", "export")  # no pin: nothing to compare
