"""`train.loss_chunks`: the head and cross entropy per chunk of tokens under checkpoint (workers/model/gpt.py)
give the whole-logits loss and gradients, the model's forward still gives logits where nothing asks for chunks,
and the job file refuses what chunks cannot serve."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.spec_errors import assert_actionable, spec_error
from workers.model.config import ModelConfig
from workers.model.gpt import chunked_lm_loss, lm_loss, model_loss
from workers.model.llama import Llama


def _case(seq: int = 13, vocab: int = 50, d: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, seq, d, generator=gen, dtype=torch.float64).float().requires_grad_()
    head = nn.Linear(d, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, d, generator=gen))
    targets = torch.randint(0, vocab, (2, seq), generator=gen)
    return hidden, head, targets


def _loss_and_grads(loss_of, hidden, head, targets, reduction):
    hidden.grad, head.weight.grad = None, None
    loss = loss_of(hidden, targets, reduction)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunks", [2, 4, 13])  # 13 tokens over 2 and 4 chunks: uneven sizes
def test_chunked_loss_and_gradients_equal_the_whole_logits(chunks, reduction):
    hidden, head, targets = _case()
    targets[0, :3] = -100  # a loss mask's prompt tokens
    targets[:, 8:] = -100  # whole chunks of ignored targets (the last chunk at every count)
    whole = _loss_and_grads(lambda h, t, r: lm_loss(head(h), t, r), hidden, head, targets, reduction)
    chunked = _loss_and_grads(lambda h, t, r: chunked_lm_loss(h, t, head, chunks, r), hidden, head, targets,
                              reduction)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_each_chunks_logits_are_recomputed_in_backward_not_kept():
    hidden, head, targets = _case(seq=16, vocab=1000)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked_lm_loss(hidden, targets, head, 4, "mean")
    logits = 2 * 16 * 1000
    assert saved and max(saved) < logits / 4  # not even one chunk's logits: recomputed in backward


def test_a_models_forward_leaves_the_head_to_the_loss_only_when_chunked():
    cfg = ModelConfig(arch="llama", vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32,
                      seq_len=12, tie_embeddings=True)
    torch.manual_seed(0)
    model = Llama(cfg)
    tokens = torch.randint(0, 64, (2, 13))
    x, y = tokens[:, :-1], tokens[:, 1:]
    assert model(x).shape == (2, 12, 64)  # generation and export: logits, as before
    model_loss(model, model(x), y).backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.loss_chunks = 5
    hidden = model(x)
    assert hidden.shape == (2, 12, 16)
    loss = model_loss(model, hidden, y)
    loss.backward()
    torch.testing.assert_close(loss, lm_loss(model.output(hidden), y), rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():  # the tied embedding/head weight included
        torch.testing.assert_close(p.grad, whole[name], rtol=1e-5, atol=1e-6)


def _raw(**sections) -> dict:
    raw = {"data": {"path": "/nonexistent"}, "model": {"seq_len": 32}}
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    return raw


@pytest.mark.parametrize(("sections", "value", "fix"), [
    ({"train": {"loss_chunks": 33}}, 33, "at most 32"),
    ({"train": {"loss_chunks": 17}, "parallel": {"cp": 2}}, 17, "at most 16"),
    ({"train": {"loss_chunks": 4, "microbatches": 4}, "parallel": {"pp": 2, "pp_schedule": "pipedream"}}, 4,
     "train.loss_chunks: 1"),
])
def test_what_chunks_cannot_serve_is_refused_naming_the_field(sections, value, fix):
    assert_actionable(spec_error(_raw(**sections)), "train.loss_chunks", value, fix)


def test_zero_chunks_is_refused_naming_the_field():
    err = spec_error(_raw(train={"loss_chunks": 0}))
    assert err.field == "train.loss_chunks" and "0" in str(err)


def test_chunks_reach_the_workers():
    from orchestrator.spec import JobSpec

    spec = JobSpec.from_dict(_raw(train={"loss_chunks": 32}))
    assert spec.worker_dict()["train"]["loss_chunks"] == 32


def test_the_planners_logits_terms_follow_the_chunk_count():
    from orchestrator.planning.memory_model import head_activation_bytes, loss_backward_bytes

    seq, mb, d, vocab = 4096, 8, 4096, 128_256
    assert loss_backward_bytes(seq, mb, vocab) == 8 * seq * mb * vocab  # 16 GiB: today's whole logits
    assert loss_backward_bytes(seq, mb, vocab, 16) == 12 * 256 * mb * vocab  # one chunk's, recomputed
    assert loss_backward_bytes(seq, mb, vocab, 3) == 12 * 1366 * mb * vocab  # the largest of uneven chunks
    grad = 4 * vocab * d  # a chunk's share of the head's gradient beside their running sum
    assert loss_backward_bytes(seq, mb, vocab, 16, grad) == 12 * 256 * mb * vocab + grad
    whole, chunked = (head_activation_bytes(seq, mb, d, vocab, loss_chunks=n) for n in (1, 16))
    assert whole - chunked == 4 * seq * mb * vocab  # no log-probabilities saved for backward


def _llama_8b(seq_len: int, loss_chunks: int):
    from orchestrator.spec import JobSpec

    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none",
                              "model": {"preset": "llama3-8b", "seq_len": seq_len},
                              "train": {"global_batch_size": 16, "microbatches": 16, "loss_chunks": loss_chunks},
                              "precision": {"dtype": "bf16"}, "memory": {"recompute": "full"}})


@pytest.mark.parametrize(("seq_len", "loss_chunks", "gpu_gb"), [
    (131072, 65536, 60),  # cp=8 was priced fastest, listed first and refused when tried
    (8192, 8192, 24),  # a cp=2 layout was offered as "faster on paper", which the job refuses
], ids=["priced-fastest", "faster-on-paper"])
def test_the_layout_picker_offers_no_cp_that_leaves_a_rank_fewer_tokens_than_chunks(seq_len, loss_chunks, gpu_gb):
    """Every layout the picker prices, shows or offers is one the job file accepts: none whose cp leaves a rank
    fewer tokens than ``train.loss_chunks`` (the spec refuses those), and the search counts the cp degrees that
    left out."""
    from orchestrator.planning.layout_picker import LONG_SEQUENCE, overrides, pick_layout
    from orchestrator.planning.layout_search import Shape

    spec = _llama_8b(seq_len, loss_chunks)
    choice = pick_layout(spec, nodes=2, gpus_per_node=8, gpu_mem=gpu_gb * 10**9)
    shown = [*choice.result.best, *([choice.unrestricted] if choice.unrestricted else [])]
    assert all(seq_len // c.layout.cp >= loss_chunks for c in shown)
    assert not choice.tried
    for c in [*choice.result.best[:5], *shown[len(choice.result.best):]]:  # what `raymesh plan --pick` prints
        spec.with_overrides(overrides(c, Shape.of(spec)))
    left_out = choice.result.rejected.get("train.loss_chunks over a rank's tokens (model.seq_len / cp)", 0)
    assert left_out > 0 or seq_len < LONG_SEQUENCE  # below it the picked search tries cp=1 only


def _plan_job(tmp_path, **train) -> str:
    job = tmp_path / "job.yaml"
    job.write_text("data: {path: /absent/data}\nmodel: {d_model: 256, n_layers: 2, n_heads: 4, seq_len: 2048, "
                   f"vocab_size: 128256}}\ntrain: {{global_batch_size: 8, microbatches: 1, {_fields(train)}}}\n")
    return str(job)


def _fields(train: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in train.items())


def test_plan_advises_loss_chunks_where_the_logits_dominate_and_counts_them(tmp_path, capsys):
    from orchestrator.cli import main

    assert main(["plan", _plan_job(tmp_path)]) == 0
    out = capsys.readouterr().out
    advice = next(line for line in out.splitlines() if line.startswith("advice: "))
    assert "set train.loss_chunks: 512" in advice and "logits take" in advice  # 128256 / 256 words a chunk
    assert main(["plan", _plan_job(tmp_path, loss_chunks=512)]) == 0
    chunked = capsys.readouterr().out
    assert "advice:" not in chunked
    from orchestrator.planning.estimate import estimate
    from orchestrator.spec import load_spec

    before, after = (max(r.total_bytes for r in estimate(load_spec(_plan_job(tmp_path, **t), [])))
                     for t in ({}, {"loss_chunks": 512}))
    assert after < before / 2


def test_plan_gives_no_chunk_advice_for_a_small_vocabulary(tmp_path, capsys):
    from orchestrator.cli import main

    job = tmp_path / "job.yaml"
    job.write_text("data: {path: /absent/data}\nmodel: {d_model: 256, n_layers: 2, n_heads: 4, seq_len: 256}\n")
    assert main(["plan", str(job)]) == 0
    assert "advice:" not in capsys.readouterr().out


def test_the_stage_profile_runs_the_head_as_the_job_will():
    """`parallel.pp_split: auto` weighs the head by its profile: chunked, it saves no logits for backward."""
    from workers.model.registry import model_config
    from workers.parallel.stage_profile import profile_model

    vocab, seq, mb = 8192, 32, 2
    fields = {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "seq_len": seq, "vocab_size": vocab}
    whole, chunked = (profile_model(model_config(fields), mb, steps=1, loss_chunks=n).head for n in (1, 4))
    logits = 4 * mb * seq * vocab
    assert whole.activation_bytes >= logits > chunked.activation_bytes


def test_the_benchmark_measures_a_step_peak_and_time_per_chunk_count():
    from benchmarks.loss_chunks import child

    row = child(chunks=4, tokens=64, d_model=16, vocab=512, repeats=1)
    assert row["chunks"] == 4 and row["step_peak_bytes"] >= 0 and row["seconds"] > 0
