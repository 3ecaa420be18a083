"""DPO (``train.objective: dpo``): the preference format (pairs aligned, masks, padding and cuts, bad lines refused
by file:line and field, the held-out split, the pair-keeping shuffle), one rank's step against DPO's formula
computed here (policy with LoRA, reference a second model without adapters), exactly log 2 with zero rewards at
LoRA's initialisation, and the refusals before start."""

from __future__ import annotations

import copy
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from orchestrator.errors import SpecError
from orchestrator.observability.run_records import step_record, summary_fields
from orchestrator.spec.runtime_checks import check_before_start
from tests.support.dpo import prepare_pairs, write_pairs
from tests.support.jobs import tiny_spec
from tests.support.one_rank import one_rank_trainer
from workers.data.loader import IGNORE_INDEX, TokenDataset
from workers.data.prepare import prepare_data
from workers.loop.summary import StepSummary
from workers.model.lora import LoRALinear

LORA = {"lora": {"rank": 4, "alpha": 8}}
DPO = {"objective": "dpo", "dpo_beta": 0.5}
SEQ = 24


def _write(path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _prepared(tmp_path, records, seq_len=SEQ, **kw):
    _write(tmp_path / "src" / "p.jsonl", records)
    prepare_data([tmp_path / "src"], tmp_path / "out", format="preference", seq_len=seq_len, **kw)
    return tmp_path / "out"


def _counted(targets: torch.Tensor) -> list[bytes]:
    return [bytes(row[row != IGNORE_INDEX].tolist()) for row in targets]


def test_each_pair_is_two_padded_sequences_whose_answers_alone_are_targets(tmp_path):
    records = [{"prompt": "2+2=", "chosen": "4", "rejected": "five"},
               {"prompt": "Capital of France? ", "chosen": "Paris", "rejected": "Rome, or so I hear"}]
    out = _prepared(tmp_path, records)
    assert json.loads((out / "manifest.json").read_text())["preference"] == {"seq_len": SEQ}
    inputs, targets = TokenDataset(out, SEQ, 0).batch(0, 4)
    assert _counted(targets) == [b"4\0", b"five\0", b"Paris", b"Rome,"]  # the second pair cut at SEQ tokens
    assert [bytes(row[:len(r["prompt"])].tolist()) for row, r in zip(inputs, [records[0]] * 2 + [records[1]] * 2)] \
        == [b"2+2="] * 2 + [b"Capital of France? "] * 2
    assert inputs[0, 6:].eq(0).all()  # padding after "2+2=4\0" is never a target
    assert targets[:, -1].eq(IGNORE_INDEX).all()  # the window's last target is the next sequence's prompt


def test_the_shuffle_keeps_every_pair_whole_and_in_order(tmp_path):
    out = prepare_pairs(tmp_path, count=40)
    ids = TokenDataset(out, 32, seed=3).global_sample_ids(0, 160)  # two epochs
    assert (ids[0::2] % 2 == 0).all() and (ids[1::2] == ids[0::2] + 1).all()
    assert sorted(ids[:80].tolist()) == list(range(80)) and ids[:80].tolist() != list(range(80))


def test_the_heldout_split_keeps_whole_pairs(tmp_path):
    write_pairs(tmp_path / "src" / "p.jsonl", 20)
    prepare_data([tmp_path / "src"], tmp_path / "out", format="preference", seq_len=32, heldout=0.25)
    train, held = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("out", "out/heldout"))
    assert (train["total_tokens"], held["total_tokens"]) == (30 * 32 + 1, 10 * 32 + 1)
    assert held["preference"] == {"seq_len": 32}


@pytest.mark.parametrize("record, expected", [
    ({"prompt": "p", "chosen": "c"}, r"p\.jsonl:2 has no 'rejected', not a string; fix: make every line one JSON "
                                     r'object \{"prompt": "\.\.\.", "chosen": "\.\.\.", "rejected": "\.\.\."\}'),
    ({"prompt": "p", "chosen": 3, "rejected": "r"}, r"p\.jsonl:2 has 3 as its 'chosen', not a string"),
    ({"prompt": "", "chosen": "c", "rejected": "r"}, r"p\.jsonl:2 has an empty 'prompt'; fix"),
    ({"prompt": "x" * 30, "chosen": "c", "rejected": "r"},
     r"p\.jsonl:2's 'prompt' is 30 tokens, leaving none of its 'chosen' answer within --seq-len 24; fix: raise"),
])
def test_a_bad_line_is_refused_naming_the_line_and_field(tmp_path, record, expected):
    with pytest.raises(ValueError, match=expected):
        _prepared(tmp_path, [{"prompt": "fine", "chosen": "a", "rejected": "b"}, record])
    assert not (tmp_path / "out").exists()


def test_seq_len_goes_with_the_preference_format_only(tmp_path):
    _write(tmp_path / "src" / "p.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    with pytest.raises(ValueError, match="--seq-len None with --format preference.*fix: pass --seq-len N"):
        prepare_data([tmp_path / "src"], tmp_path / "out", format="preference")
    with pytest.raises(ValueError, match="--seq-len 16 with --format text"):
        prepare_data([tmp_path / "src"], tmp_path / "out", seq_len=16)


def test_the_loader_refuses_another_seq_len(tmp_path):
    out = _prepared(tmp_path, [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    with pytest.raises(ValueError, match="model.seq_len 32 does not match the 24 tokens.*set model.seq_len: 24"):
        TokenDataset(out, 32, 0)


def _sequence_logps(model, inputs, targets) -> torch.Tensor:
    """Each row's summed log-probability of its counted targets, from log_softmax (not cross entropy)."""
    logp = torch.log_softmax(model(inputs).double(), -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * (targets != IGNORE_INDEX)).sum(-1)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return prepare_pairs(tmp_path_factory.mktemp("pairs"))


def test_one_rank_step_is_dpo_against_the_model_without_its_adapters(pairs, tmp_path_factory):
    """B drawn away from zero so the policy differs from the reference; the test's reference is a copy of the
    model with every adapter's B zeroed (the base alone), not the trainer's adapters switched off."""
    beta = DPO["dpo_beta"]
    with one_rank_trainer(tmp_path_factory, data={"path": str(pairs)}, model=LORA, train=DPO) as trainer:
        model = trainer.parts.modules[0]
        torch.manual_seed(1)
        with torch.no_grad():
            for layer in model.modules():
                if isinstance(layer, LoRALinear):
                    layer.lora_b.weight.normal_(0, 0.5)
        reference = copy.deepcopy(model)
        with torch.no_grad():
            for layer in reference.modules():
                if isinstance(layer, LoRALinear):
                    layer.lora_b.weight.zero_()
        inputs, targets = trainer.state.cursor.dataset.batch(0, 8)
        with torch.no_grad():
            ratio = _sequence_logps(model, inputs, targets) - _sequence_logps(reference, inputs, targets)
        rewards = beta * ratio.view(-1, 2)
        expected = float(-F.logsigmoid(rewards[:, 0] - rewards[:, 1]).mean())
        result = trainer.train_step()
    assert expected != pytest.approx(math.log(2), rel=1e-3)
    assert result.loss == pytest.approx(expected, rel=1e-5)
    assert result.dpo["chosen_reward"] == pytest.approx(float(rewards[:, 0].mean()), rel=1e-4)
    assert result.dpo["rejected_reward"] == pytest.approx(float(rewards[:, 1].mean()), rel=1e-4)
    assert result.dpo["reward_margin"] == pytest.approx(float((rewards[:, 0] - rewards[:, 1]).mean()), rel=1e-4)
    assert result.dpo["reward_accuracy"] == float((rewards[:, 0] > rewards[:, 1]).double().mean())


def test_at_initialisation_the_loss_is_log_2_and_the_rewards_zero(pairs, tmp_path_factory):
    with one_rank_trainer(tmp_path_factory, data={"path": str(pairs)}, model=LORA, train=DPO) as trainer:
        result = trainer.train_step()
    assert result.loss == pytest.approx(math.log(2), abs=1e-7)
    assert result.dpo == {"reward_accuracy": 0.0, "chosen_reward": 0.0, "rejected_reward": 0.0,
                          "reward_margin": 0.0}
    record = step_record(StepSummary.of_all([result]), step_s=1.0, tokens=256, end_time=0.0, checkpoint_s=0.0)
    assert record["dpo"] == result.dpo and summary_fields([record])["dpo"] == result.dpo  # steps.jsonl, summary


def _refusal(spec) -> str:
    with pytest.raises(SpecError) as err:
        check_before_start(spec)
    return str(err.value)


def _dpo_spec(pairs, tmp_path, model=None, parallel=None, train=None, **sections):
    return tiny_spec(pairs, tmp_path, model={**LORA, **(model or {})}, parallel=parallel or {},
                     train={**DPO, "microbatches": 1, **(train or {})}, **sections)


@pytest.mark.parametrize("change, field", [
    ({"parallel": {"pp": 2}, "train": {"microbatches": 2}}, "parallel.pp"),
    ({"parallel": {"cp": 2}}, "parallel.cp"),
    ({"parallel": {"dp": 2, "dp_sync": "ps"}}, "parallel.dp_sync"),
    ({"train": {"loss_chunks": 2}}, "train.loss_chunks"),
    ({"eval": {"every": 2, "path": "."}}, "eval.every"),
])
def test_layouts_this_version_does_not_run_are_refused(pairs, tmp_path, change, field):
    with pytest.raises(SpecError, match=f"`{field}`: value .* is not supported with train.objective: dpo.*fix: "):
        _dpo_spec(pairs, tmp_path, **change)


def test_dpo_without_lora_and_split_pairs_are_refused(pairs, tmp_path):
    with pytest.raises(SpecError, match="`train.objective`: value 'dpo' needs model.lora.*fix: add a model.lora"):
        tiny_spec(pairs, tmp_path, train=DPO)
    with pytest.raises(SpecError, match=r"global_batch_size`: value 12 gives each microbatch 3 sequence\(s\).*"
                                        "multiple of 2 x dp x microbatches = 8"):
        _dpo_spec(pairs, tmp_path, parallel={"dp": 2}, train={"global_batch_size": 12, "microbatches": 2})
    with pytest.raises(SpecError, match="`train.dpo_beta`: value 0.5 scales DPO's rewards.*objective: lm"):
        tiny_spec(pairs, tmp_path, train={"dpo_beta": 0.5})
    _dpo_spec(pairs, tmp_path, parallel={"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True})  # supported


def test_data_that_does_not_fit_the_objective_is_refused(pairs, token_data, tmp_path):
    text = _refusal(_dpo_spec(token_data, tmp_path))
    assert f"`data.path`: value '{token_data}' holds no preference pairs" in text and "--format preference" in text
    lm = _refusal(tiny_spec(pairs, tmp_path))
    assert "train on the rejected answers" in lm and "set train.objective: dpo" in lm
    other = _refusal(_dpo_spec(pairs, tmp_path, model={"seq_len": 16}))
    assert "`model.seq_len`: value 16 does not match the 32 tokens" in other and "--seq-len 16" in other
    check_before_start(_dpo_spec(pairs, tmp_path))


def test_the_rewards_reach_the_trackers_prometheus_and_the_step_line():
    """What a preference run is watched by (TRL's rewards/*): every tracker, the job's Prometheus endpoint and the
    ``event=step`` line, not only steps.jsonl; a language-model run's figures are unchanged."""
    from orchestrator.observability.observers import EventLog, StepReport
    from orchestrator.observability.prometheus import MetricsExporter
    from orchestrator.observability.trackers import step_metrics
    from tests.support.dashboards import load_dashboard, panel_exprs
    from tests.support.events import recorded_events

    rewards = {"reward_accuracy": 0.75, "chosen_reward": 0.5, "rejected_reward": -0.25, "reward_margin": 0.75}
    record = {"step": 3, "loss": 0.6, "grad_norm": 1.0, "lr": 1e-3, "tokens": 64, "step_s": 0.5,
              "tokens_per_s": 128.0, "phases": {}, "memory": {}, "dpo": rewards}
    figures = step_metrics(StepReport(record, 0.1, 0.0, 1.0), 0)
    assert {k: figures[f"dpo/{k}"] for k in rewards} == rewards
    assert not any(k.startswith("dpo/") for k in step_metrics(StepReport({**record, "dpo": None}, 0.1, 0.0, 1.0), 0))
    exporter = MetricsExporter("j", 0)
    try:
        exporter.observe_layout({"dp": 1, "pp": 1, "tp": 1, "ranks": []})
        exporter.observe_step(record, 0.1, 0.0, 1.0)
        assert {k: exporter.registry.get_sample_value("raymesh_dpo", {"job": "j", "figure": k})
                for k in rewards} == rewards
        # the dashboard's DPO panels (which the real-job Prometheus test cannot feed) select figures exported here
        selected = [re.findall(r'figure!?="(\w+)"', e) for _, e in panel_exprs(load_dashboard()) if "raymesh_dpo" in e]
        assert len(selected) == 2 and all(names and set(names) <= set(rewards) for names in selected)
    finally:
        exporter.close()
    with recorded_events() as events:
        EventLog(SimpleNamespace(log_every=1, steps=3)).on_step(StepReport(record, 0.1, 0.0, 1.0))
    (_, fields), = [e for e in events if e[0] == "step"]
    assert (fields["reward_accuracy"], fields["reward_margin"]) == ("0.750", "0.750")


@pytest.mark.parametrize("beta", [1e308, float("inf"), float("nan"), 0.0, -0.1, "0.1", True])
def test_a_dpo_beta_that_is_not_a_finite_positive_number_up_to_1000_is_refused_naming_the_field(beta):
    """1e308 passed before: its rewards overflow float32 to inf, and their differences to nan."""
    from tests.support.spec_errors import spec_error

    err = spec_error({"data": {"path": "data"}, "train": {"objective": "dpo", "dpo_beta": beta}})
    assert err.field == "train.dpo_beta" and "; fix: " in str(err)
