"""A checkpoint is data: no load raymesh makes runs code a checkpoint file carries (``workers.state.dcp_reading``).

The checksum manifest cannot stop it (anyone who can write a file can write its CRC), so each test re-seals the
checkpoint it plants a pickle in, as an attacker would, and checks the pickle did not run and the refusal names
the file."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from tests.support.damaged import payload, reseal, save_dcp, sealed_checkpoint, tiny_job
from workers.state.dcp_reading import NEVER_HELD, UnsafeCheckpoint, allowed_global, dcp_load, read_metadata


def test_generate_refuses_a_metadata_pickle_without_running_it(tmp_path, capsys):
    from orchestrator.cli.commands import main

    job = tiny_job(tmp_path)
    step = sealed_checkpoint(job)
    marker = tmp_path / "ran"
    (step / ".metadata").write_bytes(payload(marker))
    reseal(step)
    assert main(["generate", str(job), "--checkpoint", str(step), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), "the pickle in .metadata ran"
    assert f"{step / '.metadata'}" in err and "posix.mkdir" in err and NEVER_HELD in err, err
    assert "another shape" not in err and "Traceback" not in err


def test_export_hf_refuses_it_too(tmp_path, capsys):
    from orchestrator.cli.commands import main

    job = tiny_job(tmp_path, model="  arch: llama\n  seq_len: 16\n  d_model: 32\n  n_layers: 1\n  n_heads: 2\n")
    step = sealed_checkpoint(job)
    marker = tmp_path / "ran"
    (step / ".metadata").write_bytes(payload(marker))
    reseal(step)
    assert main(["export-hf", str(job), "--checkpoint", str(step), "--out", str(tmp_path / "hf")]) == 2
    assert not marker.exists() and NEVER_HELD in capsys.readouterr().err


def test_a_pickle_in_a_non_tensor_entry_is_refused_without_running_it(tmp_path):
    """DCP's own planner unpickles a ``.distcp`` file's non-tensor entries with ``weights_only=False``."""
    from workers.state.known_weights import load_known

    marker = tmp_path / "ran"
    weights = {"w": torch.ones(3)}
    save_dcp({"model": weights, "train": {"step": io.BytesIO(payload(marker)), "evil": _Evil(marker)}}, tmp_path / "c")
    state = {"model": {"w": torch.zeros(3)}, "train": {"step": io.BytesIO(), "evil": 0}}
    with warnings.catch_warnings(), pytest.raises(UnsafeCheckpoint, match=r"entry train\.evil.*posix\.mkdir"):
        warnings.simplefilter("ignore")
        load_known(state, tmp_path / "c", weights, no_dist=True)
    assert not marker.exists()


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.mkdir, (self.marker,)


def test_the_ranks_load_refuses_it_in_one_line(tmp_path_factory):
    """``CheckpointIO.load``, what a resume and a rollback from disk run on every rank."""
    from tests.support.one_rank import one_rank_trainer

    root = tmp_path_factory.mktemp("ckpt")
    marker = root / "ran"
    with one_rank_trainer(tmp_path_factory) as trainer:
        trainer.checkpoints.save(root / "step", async_save=False)
        trainer.checkpoints.load(root / "step")  # raymesh's own checkpoint: every object in it is allowed
        (root / "step" / ".metadata").write_bytes(payload(marker))
        with pytest.raises(UnsafeCheckpoint, match=f"{root / 'step' / '.metadata'} holds posix.mkdir"):
            trainer.checkpoints.load(root / "step")
    assert not marker.exists()


def test_parameter_server_shards_are_read_the_same_way(tmp_path):
    from parameter_server import checkpoint

    flat = {"w": torch.ones(4)}
    checkpoint.save(flat, tmp_path)
    assert torch.equal(checkpoint.load(tmp_path, read_metadata, dcp_load)["w"], flat["w"])
    marker = tmp_path / "ran"
    (tmp_path / checkpoint.FOLDER / ".metadata").write_bytes(payload(marker))
    with pytest.raises(UnsafeCheckpoint, match=NEVER_HELD):
        checkpoint.load(tmp_path, read_metadata, dcp_load)
    assert not marker.exists()


@pytest.mark.parametrize("garbage", [b"", b"not a pickle", pickle_of_a_list := b"\x80\x04]\x94."])
def test_a_metadata_file_that_is_no_metadata_is_named(tmp_path, garbage):
    save_dcp({"w": torch.ones(2)}, tmp_path)
    (tmp_path / ".metadata").write_bytes(garbage)
    with pytest.raises(UnsafeCheckpoint, match=f"checkpoint file {tmp_path / '.metadata'} "):
        read_metadata(tmp_path)


@pytest.mark.parametrize(("module", "name", "allowed"), [
    ("torch.distributed.checkpoint.metadata", "Metadata", True), ("torch", "bfloat16", True),
    ("torch", "Size", True), ("pathlib", "PosixPath", True), ("torch", "load", False), ("builtins", "eval", False),
    ("torch.distributed.checkpoint.metadata", "Any", False), ("os", "system", False), ("torch", "Tensor", False),
])
def test_what_metadata_may_name(module, name, allowed):
    assert (allowed_global(module, name) is not None) is allowed
