"""The held-out loss (`eval:`) without Ray: the split `prepare-data --heldout` writes, what the spec refuses, the
scorer's side effects, and the controller's records of it (on the fake rank group)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from orchestrator import JobSpec, TrainingJob
from orchestrator.cli import main
from orchestrator.errors import SpecError
from orchestrator.observability.observers import StepReport
from orchestrator.observability.prometheus import MetricsExporter
from orchestrator.observability.report import write_report
from orchestrator.observability.trackers import step_metrics
from orchestrator.spec import check_before_start
from tests.support.events import recorded_events
from tests.support.fake_group import FakeRuntime
from tests.support.jobs import TINY, tiny_spec
from tests.support.report_runs import make_run
from tests.support.spec_errors import assert_actionable, spec_error
from workers.contract.sections import EvalSection
from workers.data import TokenDataset, prepare_data
from workers.data.prepare import is_heldout
from workers.evaluation import EvalData, Evaluator
from workers.model.gpt import lm_loss
from workers.model.lora import LoRALinear
from workers.model.meta_init import build_full
from workers.model.registry import model_config

DOCS = 40  # documents in the corpus below, each 300 bytes of its own number


def doc(i: int) -> bytes:
    return f"{i:02d}".encode() * 150


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for i in range(DOCS):
        (src / f"doc{i:02d}.txt").write_bytes(doc(i))
    return src


@pytest.fixture(scope="module")
def split(sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("split")
    prepare_data([sources], out, heldout=0.1)
    return out


def _documents(root: Path) -> list[bytes]:
    """The documents of a prepared byte corpus, split at the end-of-document id (0)."""
    ds = TokenDataset(root, 1, 0)
    return bytes(ds.store.read(0, len(ds.store)).tolist()).split(b"\x00")


# -- prepare-data --heldout ----------------------------------------------------------------------------------

def test_heldout_documents_are_spread_evenly_and_never_trained_on(sources, split):
    assert [i for i in range(DOCS) if is_heldout(i, 0.1)] == [9, 19, 29, 39]
    trained, held = _documents(split), _documents(split / "heldout")
    assert held == [doc(i) for i in (9, 19, 29, 39)]
    assert not set(trained) & set(held) and len(trained) + len(held) == DOCS
    manifest = json.loads((split / "manifest.json").read_text())
    assert manifest["heldout"] == {"path": "heldout", "fraction": 0.1, "tokens": 4 * 300 + 3}
    held_manifest = json.loads((split / "heldout" / "manifest.json").read_text())
    assert held_manifest["tokenizer"] == manifest["tokenizer"] and held_manifest["heldout_of"] == ".."


def test_the_token_limit_bounds_training_and_holds_out_only_documents_walked(sources, tmp_path):
    manifest = prepare_data([sources], tmp_path, heldout=0.1, max_tokens=15 * 301)  # stops in the 16th document
    assert manifest["total_tokens"] == 15 * 301
    assert _documents(tmp_path / "heldout") == [doc(9)]  # document 19 was never walked


def test_preparing_again_without_heldout_removes_the_old_split(sources, tmp_path):
    prepare_data([sources], tmp_path, heldout=0.1)
    assert "heldout" not in prepare_data([sources], tmp_path) and not (tmp_path / "heldout").exists()
    mine = tmp_path / "heldout"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's own folder")  # not one prepare-data wrote: left alone
    prepare_data([sources], tmp_path)
    assert (mine / "notes.txt").exists()


def test_a_failed_prepare_leaves_the_earlier_dataset_whole(sources, tmp_path):
    """Nothing in --out is replaced until the new data is complete: preparing again from sources with no tokens,
    or with a held-out split that holds out nothing, fails and the earlier dataset (shards, split, manifest)
    still loads."""
    from workers.data import TokenDataset

    before = prepare_data([sources], tmp_path, heldout=0.1)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    empty, one = tmp_path.parent / "empty-src", tmp_path.parent / "one-src"
    empty.mkdir()
    one.mkdir()
    (one / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="no tokens found"):
        prepare_data([empty], tmp_path)
    with pytest.raises(ValueError, match="fix: add sources: one document cannot be split"):
        prepare_data([one], tmp_path, heldout=0.5)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == files
    assert TokenDataset(tmp_path, 16, 0).num_samples > 0  # its shards are all there and pass their checksums
    assert json.loads((tmp_path / "manifest.json").read_text()) == before


def test_a_held_out_split_never_replaces_a_folder_of_the_users(sources, tmp_path):
    (tmp_path / "heldout").mkdir()
    (tmp_path / "heldout" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a held-out split prepare-data wrote; fix: move it away"):
        prepare_data([sources], tmp_path, heldout=0.1)
    assert (tmp_path / "heldout" / "notes.txt").read_text() == "mine" and not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 2.0, math.nan])
def test_a_fraction_outside_zero_to_one_is_refused(sources, tmp_path, fraction):
    with pytest.raises(ValueError, match=r"heldout must be a fraction in \[0, 1\).*fix: e.g. --heldout 0.01"):
        prepare_data([sources], tmp_path, heldout=fraction)


def test_a_fraction_that_holds_out_nothing_names_the_smallest_that_does(sources, tmp_path):
    with pytest.raises(ValueError, match=r"of the 40 documents prepared holds out none; fix: raise --heldout to at "
                                         r"least 0.025"):
        prepare_data([sources], tmp_path, heldout=0.01)


def test_the_cli_writes_the_split_and_says_where(sources, tmp_path, capsys):
    assert main(["prepare-data", "--source", str(sources), "--out", str(tmp_path / "d"), "--heldout", "0.1"]) == 0
    out = capsys.readouterr().out
    assert f"held out 1,203 tokens of 0.1 of the documents in {tmp_path / 'd'}/heldout (set eval.path to it)" in out


# -- the spec --------------------------------------------------------------------------------------------------

def job(tmp_path: Path, **eval_fields) -> dict:
    return {**{k: dict(v) for k, v in TINY.items()}, "data": {"path": str(tmp_path / "data")},
            "run_dir": str(tmp_path / "run"), "eval": eval_fields}


def test_every_needs_a_path_and_a_path_needs_every(tmp_path):
    assert_actionable(spec_error(job(tmp_path, every=5)), "eval.path", None, "raymesh prepare-data --heldout")
    msg = assert_actionable(spec_error(job(tmp_path, path="/held")), "eval.every", 0, "set eval.every")
    assert "never evaluates" in msg


@pytest.mark.parametrize(("field", "value"), [("every", -1), ("every", "5"), ("every", True), ("every", 2.5),
                                              ("batches", 0), ("batches", 10**7), ("batches", math.inf),
                                              ("batches", None), ("path", ""), ("path", 5)])
def test_bad_values_name_the_field(tmp_path, field, value):
    err = spec_error(job(tmp_path, **{"every": 5, "path": "/held", field: value}))
    assert err.field == f"eval.{field}" and "; fix: " in str(err)


@pytest.mark.parametrize(("sections", "needs"), [
    ({"parallel": {"dp": 2, "dp_sync": "ps"}, "parameter_server": {"consistency": "ssp"}}, "consistency: bsp"),
    ({"parallel": {"pp": 2, "pp_schedule": "pipedream"}, "optim": {"grad_clip": 0.0}}, "pp_flush_per_step: true"),
])
def test_no_evaluation_where_ranks_hold_different_models(tmp_path, sections, needs):
    raw = job(tmp_path, every=5, path="/held")
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    assert_actionable(spec_error(raw), "eval.every", 5, needs)


def test_the_eval_path_is_resolved_like_the_data_path(tmp_path, monkeypatch):
    from orchestrator.spec import load_spec

    (tmp_path / "job.yaml").write_text("data: {path: data}\neval: {every: 2, path: data/heldout}\n")
    monkeypatch.chdir(tmp_path)
    assert load_spec(tmp_path / "job.yaml").eval.path == str(tmp_path / "data" / "heldout")


def test_before_start_the_eval_path_must_be_prepared_like_the_data_and_hold_enough(split, tmp_path):
    def spec(path, **train):
        return tiny_spec(split, tmp_path, eval={"every": 2, "path": str(path)}, train=train)

    check_before_start(spec(split / "heldout"))
    with pytest.raises(SpecError, match=r"eval.path.*has no prepared data.*fix: run `raymesh prepare-data"):
        check_before_start(spec(tmp_path / "nowhere"))
    # 4 documents of 300 bytes: 37 windows of 33 tokens, so 4 batches of 8 sequences do not fit; 4 of 2 do
    with pytest.raises(SpecError) as err:
        check_before_start(spec(split / "heldout", global_batch_size=16))
    assert_actionable(err.value, "eval.batches", 4, "set eval.batches to at most 2", "--heldout")
    check_before_start(spec(split / "heldout", global_batch_size=2, microbatches=1))
    other = tmp_path / "bpe-ids"  # the same directory, described as another tokenizer's ids
    other.mkdir()
    manifest = json.loads((split / "heldout" / "manifest.json").read_text())
    for shard in manifest["shards"]:
        (other / shard["file"]).write_bytes((split / "heldout" / shard["file"]).read_bytes())
    manifest["tokenizer"] = {"kind": "bpe", "path": "/t.json", "vocab_size": 256, "eos_id": 0}
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecError) as err:
        check_before_start(spec(other))
    assert_actionable(err.value, "eval.path", str(other), "training data's --tokenizer")


# -- the scorer ------------------------------------------------------------------------------------------------

def test_scoring_changes_no_mode_draws_no_random_number_and_equals_the_whole_set_at_once(split):
    spec = tiny_spec(split, split.parent, model={"lora": {"rank": 4, "dropout": 0.5}},
                     eval={"every": 1, "path": str(split / "heldout"), "batches": 2},
                     train={"global_batch_size": 2, "microbatches": 1})
    model = build_full(model_config(spec.worker_dict()["model"]), 0)
    from workers.finetune import prepare_model

    prepare_model(model, spec.model.lora, 0)
    frozen = next(m for m in model.modules() if isinstance(m, LoRALinear)).base
    frozen.eval()  # a part left in eval mode on purpose stays so
    data = EvalData(str(split / "heldout"), 32, 0, 2, 2, dp_rank=0, dp_size=1)
    rng = torch.random.get_rng_state()
    loss, seconds = Evaluator([model], data, 1, torch.device("cpu"), torch.no_grad,
                              head_part=model).run()
    assert torch.equal(torch.random.get_rng_state(), rng) and seconds > 0
    assert model.training and not frozen.training
    inputs, targets = TokenDataset(split / "heldout", 32, 0).batch(0, 4)
    model.eval()
    with torch.no_grad():
        assert loss == pytest.approx(lm_loss(model(inputs), targets).item(), rel=1e-6)  # dropout off in both


def test_the_ranks_score_after_every_nth_step_and_the_last():
    assert [s for s in range(1, 11) if EvalSection(every=4, path="/h").due(s, 10)] == [4, 8, 10]
    assert not any(EvalSection().due(s, 10) for s in range(1, 11))


# -- the controller's records ------------------------------------------------------------------------------------

def test_a_rolled_back_evaluation_is_recorded_once_and_the_event_lines_say_each(tmp_path):
    spec = tiny_spec(tmp_path / "data", tmp_path, parallel={"dp": 2}, checkpoint={"every": 0, "memory_every": 3},
                     eval={"every": 2, "path": "/held"})
    spec = JobSpec.from_dict({**spec.to_dict(), "faults": [{"kind": "kill_rank", "rank": 1, "at_step": 6}]})
    with recorded_events() as events:
        result = TrainingJob(spec, progress=False, runtime=FakeRuntime()).run()
    assert result.recoveries[0]["lost_steps"] == 2  # steps 4 and 5 ran again after the snapshot of step 3
    assert result.eval_losses == [{"step": s, "loss": 2.0 / s} for s in (2, 4, 6, 8, 10)]
    assert result.to_dict()["eval_losses"] == result.eval_losses
    scored = [(int(f["step"]), float(f["loss"])) for name, f in events if name == "eval"]
    assert scored == [(2, 1.0), (4, 0.5), (4, 0.5), (6, 0.3333), (8, 0.25), (10, 0.2)]  # step 4 again after rollback
    records = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r][-3:] == [(6, 2 / 6), (8, 0.25), (10, 0.2)]


def test_the_held_out_loss_reaches_prometheus_the_trackers_and_the_report(tmp_path):
    record = {"step": 4, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 64, "step_s": 0.5,
              "tokens_per_s": 128.0, "phases": {}, "memory": {}, "eval_loss": 1.75, "eval_s": 0.2}
    exporter = MetricsExporter("j", 0)
    try:
        exporter.observe_layout({"dp": 1, "pp": 1, "tp": 1, "ranks": []})
        exporter.observe_step(record, 0.1, 0.0, 1.0)
        assert exporter.registry.get_sample_value("raymesh_eval_loss", {"job": "j"}) == 1.75
    finally:
        exporter.close()
    assert step_metrics(StepReport(record, 0.1, 0.0, 1.0), 0)["eval_loss"] == 1.75
    assert "eval_loss" not in step_metrics(StepReport({**record, "eval_loss": None}, 0.1, 0.0, 1.0), 0)
    run = make_run(tmp_path / "run", timeline=False)
    summary = json.loads((run / "summary.json").read_text())
    summary["eval_losses"] = [{"step": 10, "loss": 2.25}, {"step": 20, "loss": 2.125}]
    (run / "summary.json").write_text(json.dumps(summary))
    page = Path(write_report(run)["html"]).read_text()
    assert "held-out loss (step 20)" in page and "2.1250" in page


def test_the_done_line_and_the_progress_bar_show_the_newest_held_out_loss(capsys):
    from orchestrator.cli.follow import report
    from orchestrator.observability.observers import ProgressBar

    summary = {"steps": 4, "final_loss": 2.5, "tokens_per_s": 1234.0, "status": "finished", "checkpoints": [],
               "losses": [3.0, 2.5], "eval_losses": [{"step": 2, "loss": 2.75}, {"step": 4, "loss": 2.625}]}
    assert report({"summary": summary}, "j", None, None) == 0
    assert capsys.readouterr().out.startswith("done: 4 steps, final loss 2.5000, held-out loss 2.6250 (step 4), ")
    bar = ProgressBar(4, 0)
    for step, held in ((1, None), (2, 2.75), (3, None)):
        record = {"step": step, "loss": 3.0, "tokens_per_s": 10.0, **({"eval_loss": held} if held else {})}
        bar.on_step(StepReport(record, 0.0, 0.0, 1.0))
    assert bar.bar.postfix == "eval=2.7500, loss=3.0000, tok_s=10"  # the newest evaluation, kept between them
    bar.on_finish()


def test_prepare_data_mistakes_are_one_line_each(tmp_path, capsys):
    """The command's own mistakes exit 2 with one line naming them, never a traceback."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"')
    cases = {("--source", str(tmp_path / "empty")): "no tokens found",
             ("--tokenizer", str(tmp_path / "bad.json")): "is not a tokenizer file `tokenizers` can read",
             ("--heldout", "1"): "heldout must be a fraction in [0, 1)",
             ("--tokenizer", "bpe:10"): "SIZE"}
    for flags, said in cases.items():
        assert main(["prepare-data", *flags, "--out", str(tmp_path / "out")]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("raymesh: error:") and said in err and "Traceback" not in err, (flags, err)


def test_the_eval_path_is_checked_by_its_tokenizer_not_by_how_it_was_made(sources, tmp_path):
    """Held-out text prepared with the training data's trained BPE (kind ``file``) is accepted; text prepared with
    another BPE of the same size (the same kind, size and eos id) is refused by its tokenizer.json's hash."""
    train, other_text = tmp_path / "train", tmp_path / "other-text"
    other_text.mkdir()
    for i in range(DOCS):
        (other_text / f"doc{i:02d}.txt").write_text(f"quite different words {i} " * 20)
    prepare_data([sources], train, tokenizer="bpe:300")
    prepare_data([other_text], tmp_path / "same", tokenizer=str(train / "tokenizer.json"))
    prepare_data([other_text], tmp_path / "other", tokenizer="bpe:300")

    def spec(name):
        return tiny_spec(train, tmp_path, eval={"every": 2, "path": str(tmp_path / name)},
                         model={"vocab_size": 300, "seq_len": 8}, train={"global_batch_size": 2, "microbatches": 1})

    check_before_start(spec("same"))
    with pytest.raises(SpecError) as err:
        check_before_start(spec("other"))
    assert_actionable(err.value, "eval.path", str(tmp_path / "other"), "training data's --tokenizer")


def test_an_eval_path_holding_the_training_data_is_refused(split, tmp_path):
    def spec(path):
        return tiny_spec(split, tmp_path, eval={"every": 2, "path": str(path)},
                         train={"global_batch_size": 2, "microbatches": 1})

    with pytest.raises(SpecError) as err:
        check_before_start(spec(split))  # the training directory itself: a training loss, named held-out
    assert_actionable(err.value, "eval.path", str(split), "--heldout 0.01")
    check_before_start(spec(split / "heldout"))
