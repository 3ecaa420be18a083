"""A resume with a changed job file: what the job file says wins where the run can take it (hyperparameters), and
what the checkpoint cannot be read as is refused before any actor starts, naming the field (one gloo rank in the
test's process, no Ray)."""

from __future__ import annotations

import pytest

from orchestrator.checkpoints import checksums, job_record
from orchestrator.errors import SpecError
from orchestrator.runtime.controller import TrainingJob
from orchestrator.spec.lora import checkpoint_to_read
from tests.support.controller_jobs import make_job
from tests.support.fake_group import FakeRuntime
from tests.support.one_rank import one_rank_trainer


def test_a_resume_trains_at_the_job_files_hyperparameters_not_the_checkpoints(tmp_path_factory, tmp_path):
    """`--resume --set optim.lr=...` (lowering the rate after a loss spike) used to be ignored: the optimizer's
    param groups and the schedule's base rate were read back from the checkpoint. The moments still are."""
    with one_rank_trainer(tmp_path_factory, optim={"lr": 1e-3, "weight_decay": 0.0, "warmup_steps": 4}) as t:
        t.train_step()
        t.checkpoints.save(tmp_path / "ckpt", async_save=False)
    changed = {"lr": 5e-4, "weight_decay": 0.1, "betas": [0.8, 0.9], "warmup_steps": 4}
    with one_rank_trainer(tmp_path_factory, optim=changed) as t:
        t.checkpoints.load(tmp_path / "ckpt")
        opt = t.state.optimizers[0]
        group = opt.param_groups[0]
        assert (group["weight_decay"], tuple(group["betas"]), group["initial_lr"]) == (0.1, (0.8, 0.9), 5e-4)
        assert all(float(s["step"]) == 1 for s in opt.state.values()) and opt.state  # the moments came back
        assert t.step == 1
        assert t.train_step().lr == pytest.approx(5e-4 * 2 / 4)  # the job's rate, at the saved schedule position


def _saved_run(tmp_path, **sections):
    """A finished fake-runtime run (no Ray, no torch ranks) with checkpoints at steps 5 and 10, as the controller
    writes them."""
    sections = {"checkpoint": {"every": 5, "memory_every": 1}, "train": {"steps": 10}, **sections}
    job = make_job(tmp_path, **sections)
    job.run()
    return job.spec


def _resume(spec, *overrides):
    """`raymesh run --resume --set ...` on the fake runtime; returns the runtime (its groups: what started)."""
    runtime = FakeRuntime()
    TrainingJob(spec.with_overrides(["train.steps=12", *overrides]), resume=True, progress=False,
                runtime=runtime).run()
    return runtime


@pytest.mark.parametrize(("override", "field"), [
    ("model.n_layers=2", "model.n_layers"),  # loaded silently before: the checkpoint's layers 2 and 3 dropped
    ("model.n_heads=8", "model.n_heads"),  # loaded silently before: the same matrices cut into other heads
    ("model.d_model=64", "model.d_model"),  # a DCP traceback on every rank, after the actors started
    ("optim.name=sgd", "optim.name"),
    ("precision.dtype=fp16", "precision.dtype"),  # no loss scale saved: a DCP traceback
    ("model.moe={experts: 4}", "model.moe.experts"),
])
def test_a_resume_the_checkpoint_cannot_be_read_by_is_refused_before_any_rank_starts(tmp_path, override, field):
    spec = _saved_run(tmp_path)
    runtime = FakeRuntime()
    changed = spec.with_overrides(["train.steps=12", override])
    with pytest.raises(SpecError, match=rf"`{field}`: value .* is not what the checkpoint .*step-00000010 was saved "
                                        r"with .* so it cannot be read to resume; fix: resume with the job file it "
                                        rf"was trained with \(--set {field}="):
        TrainingJob(changed, resume=True, progress=False, runtime=runtime).run()
    assert runtime.groups == []


@pytest.mark.parametrize(("override", "field"), [("model.n_kv_heads=4", "model.n_kv_heads"),
                                               ("model.lora.rank=4", "model.lora.rank"),
                                               ("model.lora.targets=[wq,wv]", "model.lora.targets")])
def test_a_llama_lora_resume_with_other_heads_or_adapters_is_refused(tmp_path, override, field):
    spec = _saved_run(tmp_path, model={"arch": "llama", "n_kv_heads": 2, "lora": {"rank": 8}})
    with pytest.raises(SpecError, match=rf"`{field}`: value .* is not what the checkpoint"):
        _resume(spec, override)


@pytest.mark.parametrize(("override", "field"), [("model.head_dim=16", "model.head_dim"),
                                               ("model.qk_norm=false,model.hf_model_type=llama", "model.qk_norm")])
def test_a_qwen3_resume_with_another_head_width_or_without_its_norms_is_refused(tmp_path, override, field):
    """Qwen3's fields: heads 16 wide make q/k/v/o of other shapes (DCP's traceback on every rank), and a model
    without q/k norms leaves the saved ones unread."""
    spec = _saved_run(tmp_path, model={"arch": "llama", "n_kv_heads": 2, "qk_norm": True, "hf_model_type": "qwen3"})
    with pytest.raises(SpecError, match=rf"`{field}`: value .* is not what the checkpoint"):
        _resume(spec, *override.split(","))


def test_layout_precision_and_adam_changes_still_resume(tmp_path):
    """What DCP reshards or reads the same (dp, tp padding to the same rows, bf16 over fp32 masters, adam over
    adamw's moments, the rate) is not refused."""
    spec = _saved_run(tmp_path, model={"vocab_size": 256})
    runtime = _resume(spec, "parallel.dp=1", "parallel.tp=2", "precision.dtype=bf16", "optim.name=adam",
                      "optim.lr=1e-4")
    assert runtime.groups and runtime.groups[0].spec.parallel.tp == 2


def test_a_tp_that_pads_the_vocabulary_to_other_rows_is_refused_naming_the_tp_that_fit(tmp_path):
    spec = _saved_run(tmp_path, model={"vocab_size": 250}, parallel={"dp": 1, "tp": 2})
    with pytest.raises(SpecError, match=r"`parallel.tp`: value 4 pads model.vocab_size 250 to 252 rows, and the "
                                        r"checkpoint .* \(saved at parallel.tp=2\) holds embedding and head rows for "
                                        r"250.*fix: resume with a parallel.tp that pads 250 to 250 rows: 1, 2, 5, 10, "
                                        r"25, 50$"):
        _resume(spec, "parallel.tp=4")


def test_an_export_or_generate_with_another_shape_is_refused_naming_the_field(tmp_path):
    """The exports and `generate` load the checkpoint whole in one process, where fewer layers loaded silently."""
    spec = _saved_run(tmp_path)
    with pytest.raises(SpecError, match=r"`model.n_layers`: value 2 .* cannot be read to export"):
        checkpoint_to_read(spec.with_overrides(["model.n_layers=2"]), None, "export")


def test_a_checkpoint_saved_before_the_record_is_not_checked(tmp_path):
    spec = _saved_run(tmp_path)
    for step in (5, 10):
        (spec.checkpoint_dir() / f"step-{step:08d}" / job_record.RECORD).unlink()
        checksums.write_manifest(spec.checkpoint_dir() / f"step-{step:08d}")
    assert _resume(spec, "model.n_layers=2").groups


def test_a_checkpoint_without_its_record_holding_more_layers_is_refused_on_the_rank(tmp_path_factory, tmp_path):
    """A checkpoint saved before `job.json` existed is not checked by the controller; its layers 2 and 3 used to be
    dropped without a word by a job of 2 layers (DCP reads only the keys the model asks for)."""
    from workers.state.known_weights import UnknownWeights

    with one_rank_trainer(tmp_path_factory) as t:
        t.checkpoints.save(tmp_path / "ckpt", async_save=False)
    with one_rank_trainer(tmp_path_factory, model={"n_layers": 2}) as t, \
            pytest.raises(UnknownWeights, match=r"^checkpoint .*ckpt holds model weights this job's model has none "
                                                r"of \(layers\.2\.\S+, layers\.2\.\S+, layers\.2\.\S+ and \d+ more\); "
                                                r"it was saved with 4 layers, the job builds 2, .*fix: load it with "
                                                r"the job file it was trained with \(--set model.n_layers=4\)"):
        t.checkpoints.load(tmp_path / "ckpt")


def test_the_layer_check_reads_every_stages_keys_and_one_process_loads_are_checked_too(tmp_path):
    """A pipeline stage asks for its own layers only: against the names of all stages nothing is refused. The
    exports' and `generate`'s whole-model read (`load_dcp_model`) refuses fewer layers the same way."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from workers.finetune import load_dcp_model
    from workers.model.config import ModelConfig
    from workers.model.registry import build_model
    from workers.state.known_weights import UnknownWeights, load_known

    model = build_model(ModelConfig(d_model=32, n_layers=4, n_heads=4, d_ff=64, seq_len=32)).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's warnings about one process
        dcp.save({"model": model}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
        later = ("layers.2.", "layers.3.", "norm", "output")  # the second stage's
        first = {k: v.clone() for k, v in model.items() if not k.startswith(later)}
        load_known({"model": first}, tmp_path / "ckpt", model, no_dist=True)
        with pytest.raises(UnknownWeights, match=r"layers\.2\..* saved with 4 layers, the job builds 2"):
            load_known({"model": first}, tmp_path / "ckpt", first, no_dist=True)
        with pytest.raises(UnknownWeights, match=r"--set model.n_layers=4"):
            load_dcp_model(build_model(ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=32)),
                           tmp_path / "ckpt")


def test_a_checkpoint_keeping_experts_one_key_per_expert_is_refused_naming_them(tmp_path):
    """Expert-parallel saves once split each expert stack into ``<weight>.expert<e>`` keys, which no layout reads
    now that stacks are saved whole: refused in one line naming them, not DCP's "Missing key" per rank."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from workers.state.known_weights import UnknownWeights, load_known

    weight = "layers.0.feed_forward.experts.w1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's warnings about one process
        dcp.save({"model": {f"{weight}.expert{e}": torch.ones(3, 2) for e in range(2)}},
                 checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
        with pytest.raises(UnknownWeights, match=rf"keeps its experts one key per expert \({weight}\.expert0, "
                                                 rf"{weight}\.expert1\).*fix: resume it with the raymesh version"):
            load_known({"model": {weight: torch.zeros(2, 3, 2)}}, tmp_path / "ckpt", [weight], no_dist=True)
