"""Supervised fine-tuning data (`raymesh prepare-data --format prompt-completion`): prompt/completion pairs whose
completion tokens alone are targets. Prepared ids and loss-mask flags against a hand tokenization, bad lines refused
by file:line, the held-out split, the loader's ignored targets (raw file and row groups, a mixture, cp), the
single-process reference against cross entropy computed by hand, one rank's step on masked and on ordinary data,
and the refusals before start."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from orchestrator.errors import SpecError
from orchestrator.spec.runtime_checks import check_before_start
from tests.support.jobs import tiny_spec
from tests.support.one_rank import one_rank_trainer
from tests.support.reference import reference_run
from workers.data import loader
from workers.data.loader import IGNORE_INDEX, DataCursor, MixedDataset, TokenDataset
from workers.data.prepare import prepare_data
from workers.model.meta_init import build_full
from workers.model.registry import model_config
from workers.step.objectives import MaskedLM, MeanLM

PAIRS = [("Q: 2+2?\nA:", " 4"), ("Translate 'chat':", " cat, a small furry animal that purrs"),
         ("", "no prompt at all"), ("Say nothing.", "")]


def _write_jsonl(path, pairs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))


def _by_hand(pairs) -> tuple[list[int], list[int]]:
    """Bytes ids and flags as the format defines them: prompt (0s), completion (1s), byte 0 (a 1) between."""
    ids, flags = [], []
    for i, (prompt, completion) in enumerate(pairs):
        sep = [0] if i else []
        ids += sep + list(prompt.encode()) + list(completion.encode())
        flags += [1] * len(sep) + [0] * len(prompt.encode()) + [1] * len(completion.encode())
    return ids, flags


def test_prepared_ids_and_flags_are_the_hand_tokenization(tmp_path):
    _write_jsonl(tmp_path / "src" / "a.jsonl", PAIRS)
    manifest = prepare_data([tmp_path / "src"], tmp_path / "out", format="prompt-completion")
    table = pq.read_table(tmp_path / "out" / manifest["shards"][0]["file"]).to_pydict()
    assert (table["tokens"], table["loss_mask"]) == _by_hand(PAIRS)
    assert manifest["loss_mask"] is True


@pytest.mark.parametrize(("line", "why"), [
    ("{not json", "is not JSON"), ('["prompt", "completion"]', "holds a JSON list, not an object"),
    ('{"prompt": "a"}', "has no 'completion', not a string"),
    ('{"prompt": 3, "completion": "b"}', "has 3 as its 'prompt', not a string"),
])
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path, line, why):
    src = tmp_path / "src" / "a.jsonl"
    _write_jsonl(src, PAIRS[:2])
    src.write_text(src.read_text() + "\n" + line + "\n")  # a blank line 3 is skipped, line 4 is the bad one
    with pytest.raises(ValueError, match=re.escape(f"{src}:4 {why}")) as err:
        prepare_data([tmp_path / "src"], tmp_path / "out", format="prompt-completion")
    assert "fix:" in str(err.value) and not (tmp_path / "out").exists()


def test_the_heldout_split_keeps_whole_examples_and_their_mask(tmp_path):
    pairs = [(f"prompt {i}:", f" completion {i}") for i in range(10)]
    _write_jsonl(tmp_path / "src" / "a.jsonl", pairs)
    prepare_data([tmp_path / "src"], tmp_path / "out", format="prompt-completion", heldout=0.2)
    held = json.loads((tmp_path / "out" / "heldout" / "manifest.json").read_text())
    table = pq.read_table(tmp_path / "out" / "heldout" / held["shards"][0]["file"]).to_pydict()
    assert held["loss_mask"] and (table["tokens"], table["loss_mask"]) == _by_hand([pairs[4], pairs[9]])


@pytest.fixture
def masked(tmp_path):
    _write_jsonl(tmp_path / "src" / "a.jsonl", PAIRS * 8)
    prepare_data([tmp_path / "src"], tmp_path / "sft", format="prompt-completion")
    return tmp_path / "sft"


def _expected_targets(pairs, seq_len: int, sample_ids) -> torch.Tensor:
    ids, flags = (np.array(v) for v in _by_hand(pairs))
    rows = [np.where(flags[s * seq_len + 1:(s + 1) * seq_len + 1] == 1, ids[s * seq_len + 1:(s + 1) * seq_len + 1],
                     IGNORE_INDEX) for s in sample_ids]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


@pytest.mark.parametrize("reader", ["raw", "row groups"])
def test_the_loader_ignores_targets_that_are_not_completion_tokens(masked, reader, monkeypatch, tmp_path):
    if reader == "row groups":  # neither raw folder writable: the ShardStore reads the loss-mask column itself
        monkeypatch.setattr(loader, "raw_folders", lambda root: (tmp_path / "no" / "a", tmp_path / "no" / "b"))
        (tmp_path / "no").write_text("a file, so no folder can be made under it")
    ds = TokenDataset(masked, seq_len=16, seed=0)
    assert isinstance(ds.flags, loader.ShardStore if reader == "row groups" else loader.RawTokens)
    if reader == "raw":  # the flags' raw file sits beside the ids', neither dropped as another corpus's
        assert ds.store.path.exists() and ds.flags.path.exists() and ds.flags.path != ds.store.path
        ids_file = ds.store.path.stat().st_ino  # (ds keeps it open: a rebuilt file cannot reuse the inode)
        ds.flags.path.unlink()  # built again alone (say a full disk failed it): the ids' file is the same corpus's
        assert TokenDataset(masked, seq_len=16, seed=0).flags.path.exists()
        assert ds.store.path.stat().st_ino == ids_file  # neither dropped as stale nor decoded again
    inputs, targets = ds.batch(0, 4)
    assert (inputs >= 0).all()  # every token is read: only targets are masked
    assert torch.equal(targets, _expected_targets(PAIRS * 8, 16, ds.global_sample_ids(0, 4)))
    first = _by_hand(PAIRS[:1])[0]  # "...A:" then " 4": the last prompt token's target is the first completion one
    whole = TokenDataset(masked, seq_len=len(first) - 1, seed=0)
    row = int(np.flatnonzero(whole.global_sample_ids(0, whole.num_samples) == 0)[0])
    assert whole.batch(row, 1)[1][0, -3:].tolist() == [IGNORE_INDEX, *first[-2:]]


def test_a_mixture_counts_every_target_of_a_source_without_mask_and_cp_splits_targets(masked, tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("plain text, every token a target " * 20)
    prepare_data([tmp_path / "text"], tmp_path / "plain")
    mix = MixedDataset([(str(masked), 1.0), (str(tmp_path / "plain"), 1.0)], seq_len=16, seed=0)
    pairs = mix.global_sample_ids(0, 8)
    _, targets = mix.batch(0, 8)
    plain = pairs[:, 0] == 1
    assert mix.loss_mask and plain.any() and not (targets[torch.from_numpy(plain)] == IGNORE_INDEX).any()
    assert torch.equal(targets[torch.from_numpy(~plain)],
                       _expected_targets(PAIRS * 8, 16, pairs[~plain, 1]))
    halves = [DataCursor(mix, 8, 0, 1, cp_rank=r, cp_size=2).next_batch()[1] for r in range(2)]
    assert sorted(torch.cat(halves, 1).flatten().tolist()) == sorted(targets.flatten().tolist())


def test_the_reference_loss_is_cross_entropy_over_the_counted_targets(masked, tmp_path):
    spec = tiny_spec(masked, tmp_path, model={"seq_len": 16}, train={"steps": 1})
    model = build_full(model_config(spec.worker_dict()["model"]), spec.train.seed)
    ids = TokenDataset(masked, 16, spec.data.seed).global_sample_ids(0, 8)
    raw = TokenDataset(masked, 16, spec.data.seed).store.windows(ids * 16, 17).astype(np.int64)
    targets = _expected_targets(PAIRS * 8, 16, ids)  # built from the hand tokenization, not by the loader
    with torch.no_grad():
        logits = model(torch.from_numpy(raw[:, :-1]))
    by_hand = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    unmasked = F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(raw[:, 1:]).flatten())
    assert reference_run(spec, 1)[0][0] == pytest.approx(float(by_hand), rel=1e-6)
    assert float(by_hand) != pytest.approx(float(unmasked), rel=1e-3)


def test_one_rank_step_is_the_global_masked_mean_over_unequal_microbatches(masked, tmp_path_factory):
    with one_rank_trainer(tmp_path_factory, data={"path": str(masked)}, model={"seq_len": 16}) as trainer:
        model = trainer.parts.modules[0]
        inputs, targets = trainer.state.cursor.dataset.batch(0, 8)
        counts = [(y != IGNORE_INDEX).sum() for y in targets.chunk(2)]
        expected = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        expected.backward()
        expected = expected.detach()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        result = trainer.train_step()
    assert counts[0] != counts[1]
    assert result.loss == pytest.approx(float(expected), rel=1e-6)
    assert result.grad_norm == pytest.approx(float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in grads]))), rel=1e-5)


def test_ordinary_data_keeps_the_mean_of_microbatch_means_bit_for_bit(tmp_path_factory):
    """Data without a mask takes the old path: the step's loss is exactly the sum of each microbatch's mean / 2."""
    with one_rank_trainer(tmp_path_factory) as trainer:
        model = trainer.parts.modules[0]
        inputs, targets = trainer.state.cursor.dataset.batch(0, 8)
        expected = torch.zeros(())
        for x, y in zip(inputs.chunk(2), targets.chunk(2)):
            expected += (F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(0, 1)) / 2).detach()
        result = trainer.train_step()
    assert type(trainer.objective) is MeanLM and result.loss == float(expected)


def test_a_batch_without_counted_targets_has_loss_zero_and_says_so(tmp_path, tmp_path_factory, caplog):
    _write_jsonl(tmp_path / "src" / "a.jsonl", [("a prompt and no completion " * 20, "")])
    prepare_data([tmp_path / "src"], tmp_path / "sft", format="prompt-completion")
    with caplog.at_level(logging.WARNING, "workers.step.objectives"), \
            one_rank_trainer(tmp_path_factory, data={"path": str(tmp_path / "sft")}, model={"seq_len": 16}) as t:
        result = t.train_step()
    assert result.loss == 0.0 and result.grad_norm == 0.0
    assert "no target of the global batch is a completion token" in caplog.text


def _refusal(spec) -> str:
    with pytest.raises(SpecError) as err:
        check_before_start(spec)
    return str(err.value)


def test_what_cannot_normalise_over_the_global_count_is_refused(masked, tmp_path):
    ps = tiny_spec(masked, tmp_path, model={"seq_len": 16}, parallel={"dp": 2, "dp_sync": "ps"})
    assert "parallel.dp_sync" in _refusal(ps) and str(masked) in _refusal(ps)
    pipedream = tiny_spec(masked, tmp_path, model={"seq_len": 16}, parallel={"pp": 2, "pp_schedule": "pipedream"})
    assert "parallel.pp_schedule" in _refusal(pipedream) and "synchronous schedule" in _refusal(pipedream)


def test_an_eval_path_scored_otherwise_than_training_is_refused(masked, tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("plain text, every token a target " * 40)
    prepare_data([tmp_path / "text"], tmp_path / "plain")
    for data, held, says in ((masked, tmp_path / "plain", "has no loss mask"),
                             (tmp_path / "plain", masked, "carries a loss mask")):
        spec = tiny_spec(data, tmp_path, model={"seq_len": 16}, eval={"every": 1, "path": str(held)})
        message = _refusal(spec)
        assert "eval.path" in message and says in message and str(data) in message and "fix:" in message


def test_the_cli_prepares_prompt_completion_pairs(tmp_path, capsys):
    from orchestrator.cli import main

    _write_jsonl(tmp_path / "src" / "a.jsonl", PAIRS)
    assert main(["prepare-data", "--format", "prompt-completion", "--source", str(tmp_path / "src"),
                 "--out", str(tmp_path / "out")]) == 0
    assert "only completion tokens are targets" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["loss_mask"] is True


@pytest.mark.parametrize("mixed", [False, True], ids=["sft", "sft-and-plain-text-mix"])
def test_an_interrupted_sft_run_resumed_from_checkpoint_or_snapshot_is_the_uninterrupted_one(mixed, tmp_path,
                                                                                             tmp_path_factory):
    """Stopped after 2 of 4 steps and resumed, from its DCP checkpoint or from an in-memory snapshot restored into
    a freshly built trainer (a replaced rank), the run's losses, held-out losses and weights are the uninterrupted
    run's bit for bit: the masked batches (alone, or mixed with text whose every target counts), their
    counted-target scale and the held-out set continue where they were."""
    from workers.state import snapshot

    pairs = [(f"prompt {i} " + "p" * (i % 7), " completion" * (i % 4)) for i in range(64)]
    _write_jsonl(tmp_path / "src" / "a.jsonl", pairs)
    prepare_data([tmp_path / "src"], tmp_path / "sft", format="prompt-completion", heldout=0.2)
    data = {"path": str(tmp_path / "sft")}
    if mixed:
        (tmp_path / "text").mkdir()
        (tmp_path / "text" / "a.txt").write_text("plain text, every token a target " * 20)
        prepare_data([tmp_path / "text"], tmp_path / "plain")
        data = {"mix": [{"path": data["path"], "weight": 0.7}, {"path": str(tmp_path / "plain"), "weight": 0.3}]}
    sections = {"data": data, "model": {"seq_len": 16}, "train": {"steps": 4},
                "eval": {"every": 1, "batches": 1, "path": str(tmp_path / "sft" / "heldout")}}

    def steps(trainer, n: int) -> list[tuple[float, float]]:
        return [(r.loss, r.eval_loss) for r in (trainer.train_step() for _ in range(n))]

    def weights(trainer) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in trainer.parts.modules[0].named_parameters()}

    with one_rank_trainer(tmp_path_factory, **sections) as t:
        assert t.state.cursor.dataset.loss_mask
        steps(t, 2)
        t.checkpoints.save(tmp_path / "ckpt", async_save=False)
        snap = snapshot.take(t.state)
        straight, final = steps(t, 2), weights(t)
    assert type(t.objective) is MaskedLM and all(eval_loss is not None for _, eval_loss in straight)
    for resume in (lambda r: r.checkpoints.load(tmp_path / "ckpt"), lambda r: snapshot.restore(r.state, snap)):
        with one_rank_trainer(tmp_path_factory, **sections) as r:
            resume(r)
            assert steps(r, 2) == straight
            assert all(torch.equal(p, final[n]) for n, p in weights(r).items())
