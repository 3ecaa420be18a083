"""Decoding and sampling (``workers.model.generation``): the key/value cache gives the logits a full forward
gives, greedy decoding equals ``transformers``' ``generate`` on a Llama, and each sampling filter draws only
what it keeps."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf import hf_llama, raymesh_llama_from
from workers.data.tokenizer import ByteTokens, recorded_tokenizer, train_bpe
from workers.model.config import ModelConfig
from workers.model.generation import KVCache, Sampling, generate, next_token
from workers.model.registry import build_model

GREEDY = Sampling(temperature=0.0)
SHAPES = {
    "gpt-learned": {"positions": "learned"},
    "gpt-rotary": {"positions": "rotary"},
    # every token routed (capacity 8x): with drops, which tokens drop depends on how many are routed at once
    "gpt-moe": {"moe": {"experts": 4, "router": "topk", "capacity_factor": 8.0}},
    "llama-gqa": {"arch": "llama", "n_kv_heads": 2, "tie_embeddings": True,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8}},
}


def _model(name: str, seq_len: int = 24, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(**{"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 48,
                         "seq_len": seq_len, "init_std": 0.2, **SHAPES[name]})
    return build_model(cfg).eval()


@pytest.mark.parametrize("name", list(SHAPES))
def test_cached_decoding_gives_the_full_forward_logits(name):
    """A prefix of 5, then one token at a time, then a chunk of 3: every position's logits as one forward over
    the whole sequence gives them."""
    model = _model(name)
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model)
        parts = [cache.forward(tokens[:, :5])]
        parts += [cache.forward(tokens[:, i:i + 1]) for i in range(5, 17)]
        parts.append(cache.forward(tokens[:, 17:]))
        cache.close()
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert all(m.context_shard is None for m in model.modules() if hasattr(m, "context_shard"))


def _uncached_greedy(model, prompt: list[int], max_new: int, window: int, keep: int) -> list[int]:
    """Greedy decoding with a full forward per token over the same windows ``generate`` keeps: the model sees
    the tokens since the segment start; when that would pass ``window``, the segment restarts ``keep`` back."""
    context, start = list(prompt), 0
    with torch.no_grad():
        for _ in range(max_new):
            if len(context) - start > window:
                start = len(context) - keep
            logits = model(torch.tensor([context[start:]]))[0, -1]
            context.append(int(logits.argmax()))
    return context[len(prompt):]


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_decoding_runs_past_the_window_like_a_full_forward_per_token(name):
    """50 new tokens through a 16-token window: the cache is rebuilt from the newest 8 tokens three times."""
    model = _model(name, seq_len=16)
    prompt = [3, 1, 4, 1, 5]
    got = generate(model, prompt, 50, GREEDY, window=16)
    assert got == [_uncached_greedy(model, prompt, 50, window=16, keep=8)]
    assert model.training is False


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}], ids=["gqa-llama3-rope", "tied"])
def test_greedy_decoding_equals_transformers_generate(overrides):
    """``transformers``' own decoding (its cache, its positions) on the same weights picks the same tokens."""
    hf = hf_llama(**overrides)
    ours = raymesh_llama_from(hf)
    prompt = [7, 200, 13, 42, 99, 5]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 40, GREEDY, window=64) == [expected]
    assert len(set(expected)) > 2  # a sequence worth comparing, not one token repeated


def test_sampling_is_reproducible_from_its_seed_and_samples_differ():
    model = _model("gpt-rotary")
    draw = Sampling(temperature=1.0, top_k=0, seed=7)
    first = generate(model, [1, 2, 3], 12, draw, window=24, samples=3)
    assert first == generate(model, [1, 2, 3], 12, draw, window=24, samples=3)
    assert first != generate(model, [1, 2, 3], 12, Sampling(temperature=1.0, top_k=0, seed=8), window=24, samples=3)
    assert len({tuple(s) for s in first}) == 3


def test_a_sample_ends_at_the_stop_id_and_keeps_it():
    """With the stop id set to what greedy decoding draws 4th, the sample is those 4 ids; the others go on."""
    model = _model("gpt-learned")
    run_on = generate(model, [9], 10, GREEDY, window=24)[0]
    stop = run_on[3]
    ended = generate(model, [9], 10, Sampling(temperature=0.0, stop=stop), window=24)[0]
    assert ended == run_on[: run_on.index(stop) + 1]


def _draws(logits: torch.Tensor, sampling: Sampling, n: int = 20000) -> torch.Tensor:
    rows = logits.expand(n, -1)
    return next_token(rows, sampling, torch.Generator().manual_seed(sampling.seed))


def test_draws_follow_the_softmax_of_the_tempered_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    counts = torch.bincount(_draws(logits, Sampling(temperature=0.5, top_k=0)), minlength=4) / 20000
    torch.testing.assert_close(counts, (logits[0] / 0.5).softmax(-1), atol=0.01, rtol=0)


def test_top_k_top_p_and_vocab_draw_only_what_they_keep():
    logits = torch.tensor([[0.1, 3.0, 2.9, 0.2, 2.8, 9.0]])
    top_k = set(_draws(logits, Sampling(temperature=3.0, top_k=3, vocab=5)).tolist())
    assert top_k == {1, 2, 4}  # id 5 is past the tokenizer's vocabulary (a padded head): never drawn
    probs = (logits[0, :5] / 3.0).softmax(-1)  # 1, 2, 4 hold ~0.86 of it; 1 and 2 ~0.59
    nucleus = set(_draws(logits, Sampling(temperature=3.0, top_k=0, top_p=0.5, vocab=5)).tolist())
    assert probs[[1, 2]].sum() > 0.5 > probs[1] and nucleus == {1, 2}
    assert set(_draws(logits, Sampling(temperature=3.0, top_k=0, top_p=1e-6)).tolist()) == {5}
    assert next_token(logits, Sampling(temperature=0.0, vocab=5), None).tolist() == [1]


def test_a_prompt_must_leave_room_in_the_window():
    with pytest.raises(ValueError, match="between 1 and 15"):
        generate(_model("gpt-learned", seq_len=16), list(range(16)), 4, GREEDY, window=16)


def test_recorded_tokenizers_decode_what_they_encode(tmp_path):
    text = "def f(x):\n    return x  # naïve ✓\n"
    tok = recorded_tokenizer({"kind": "bytes"}, tmp_path)
    assert isinstance(tok, ByteTokens) and tok.decode(tok.encode(text.encode()).tolist()) == text
    trained = train_bpe([text.encode() * 20, b"import os\n" * 50], 300, tmp_path / "tokenizer.json")
    moved = {"kind": "bpe", "path": "/elsewhere/tokenizer.json", "vocab_size": trained.vocab_size, "eos_id": 0}
    bpe = recorded_tokenizer(moved, tmp_path)  # found beside the shards, wherever it was trained
    ids = bpe.encode(text.encode()).tolist()
    assert len(ids) < len(text.encode()) and bpe.decode(ids) == text
    with pytest.raises(LookupError, match="token ids"):
        recorded_tokenizer({"kind": "ids", "vocab_size": 10}, tmp_path)


@pytest.fixture
def tiny_job(tmp_path):
    """A job file over a few hundred bytes of prepared text, with no checkpoint yet."""
    from workers.data.prepare import prepare_data

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def f(x):\n    return x\n" * 20)
    prepare_data([tmp_path / "src"], tmp_path / "data")
    job = tmp_path / "job.yaml"
    job.write_text(f"data:\n  path: {tmp_path / 'data'}\nmodel:\n  seq_len: 16\nrun_dir: {tmp_path / 'run'}\n")
    return job


@pytest.mark.parametrize(("args", "field", "fix"), [
    (["--prompt", "x" * 15], "`--prompt`", "shorten the prompt to at most 14 tokens"),
    ([], "`checkpoint.dir`", "run the job with checkpoint.every > 0 first, or pass --checkpoint STEP_DIR"),
    (["--checkpoint", "nowhere"], "`--checkpoint`", "pass --checkpoint STEP_DIR"),
    (["--set", "data.path=/nowhere"], "`data.path`", "raymesh prepare-data --out /nowhere"),
])
def test_generate_refuses_bad_input_naming_the_field_and_the_fix(tiny_job, args, field, fix, capsys):
    from orchestrator.cli.commands import main

    assert main(["generate", str(tiny_job), *args]) == 2
    err = capsys.readouterr().err
    assert field in err and fix in err, err


def test_generate_refuses_data_without_a_tokenizer(tiny_job, capsys):
    import json

    from orchestrator.cli.commands import main

    manifest = tiny_job.parent / "data" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "tokenizer": {"kind": "ids"}}))
    assert main(["generate", str(tiny_job)]) == 2
    err = capsys.readouterr().err
    assert "`data.path`" in err and "token ids" in err and "prepare-data" in err


@pytest.mark.parametrize(("option", "value"), [("--temperature", "inf"), ("--temperature", "-1"),
                                               ("--temperature", "nan"), ("--top-p", "0"), ("--top-p", "1.5"),
                                               ("--top-k", "-3"), ("--max-new-tokens", "0"), ("--samples", "x")])
def test_generate_options_out_of_range_are_refused_by_name(tiny_job, option, value, capsys):
    from orchestrator.cli.commands import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(tiny_job), option, value])
    assert exit_.value.code == 2 and f"argument {option}: {value!r} is not" in capsys.readouterr().err


def test_a_checkpoint_of_another_shape_is_refused_in_one_line(tmp_path):
    """`generate` and the exports rebuild the model from the job file: edited since the run (here d_model), the
    load names the first tensor that does not fit and the fix, instead of DCP's tens of lines."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from tests.support.models import SMALL_MODEL
    from workers.finetune import load_dcp_model
    from workers.model.gpt import GPT
    from workers.model.registry import model_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves in one process
        dcp.save({"model": GPT(model_config(SMALL_MODEL)).state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    other = GPT(model_config({**SMALL_MODEL, "d_model": SMALL_MODEL["d_model"] * 2}))
    with pytest.raises(ValueError, match=r"another shape than the job file describes \(.*Size mismatch.*\); fix: "
                                         r"pass the job file"):
        load_dcp_model(other, tmp_path)
