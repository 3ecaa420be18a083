"""raymesh's Llama against ``transformers``' LlamaForCausalLM on the same weights (float32, CPU, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf import hf_llama, raymesh_llama_from, save_hf_llama
from workers.model import hf_io
from workers.model.config import ModelConfig
from workers.model.gpt import init_parameter  # the Llama family registers the GPT's init rule
from workers.model.llama import Llama
from workers.model.registry import build_model


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"rope_scaling": None}],
                         ids=["gqa-llama3-rope", "tied", "plain-rope"])
def test_logits_equal_transformers(overrides):
    hf = hf_llama(**overrides)
    ours = raymesh_llama_from(hf)
    assert isinstance(ours, Llama) and ours.cfg.kv_heads == 2
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_rope_scaling_changes_the_logits():
    """The scaling is exercised at all: the same weights without it give different logits."""
    hf = hf_llama()
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        scaled = raymesh_llama_from(hf)(tokens)
        plain = raymesh_llama_from(hf, rope_scaling=None)(tokens)
    assert (scaled - plain).abs().max() > 1e-3


def test_swiglu_width_follows_llama_rule():
    assert ModelConfig(arch="llama", d_model=4096, multiple_of=1024, ffn_dim_multiplier=1.3).ffn_dim == 14336
    assert ModelConfig(arch="llama", d_model=64, multiple_of=32).ffn_dim == 192  # int(2*256/3)=170 -> 192
    assert ModelConfig(arch="llama", d_model=64, d_ff=100).ffn_dim == 100


def test_init_is_per_parameter_and_seeded():
    """Same seed, same weights; each parameter from its own generator (what meta-device init calls)."""
    cfg = ModelConfig(arch="llama", d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=48)
    torch.manual_seed(3)
    a = build_model(cfg)
    torch.manual_seed(3)
    b = build_model(cfg)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    wo = init_parameter("layers.0.attention.wo.weight", (32, 32), gen(), cfg)
    wq = init_parameter("layers.0.attention.wq.weight", (32, 32), gen(), cfg)
    assert torch.allclose(wo * 2, wq)  # same draws, residual projection scaled by 1/sqrt(2 * n_layers)
    assert torch.equal(init_parameter("norm.weight", (32,), gen(), cfg), torch.ones(32))


@pytest.mark.parametrize(("shard", "tied"), [(None, False), ("20KB", False), (None, True)],
                         ids=["single-file", "sharded-index", "tied"])
def test_hf_directory_loads_into_the_model_and_writes_back_exactly(tmp_path, shard, tied):
    from transformers import LlamaForCausalLM

    src = save_hf_llama(tmp_path / "hf", max_shard_size=shard, tie_word_embeddings=tied)
    assert (src / hf_io.INDEX).is_file() == (shard is not None)
    cfg = ModelConfig(**{**hf_io.config_fields(hf_io.read_config(src)), "seq_len": 64})
    model = build_model(cfg)
    read = hf_io.load_hf_weights(model, src)
    assert len(read) == len(list(model.parameters()))
    out = hf_io.write_hf(model.state_dict(), cfg, tmp_path / "out")
    back = LlamaForCausalLM.from_pretrained(out).state_dict()
    original = LlamaForCausalLM.from_pretrained(src).state_dict()
    assert back.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(back[key], value), key
    tokens = torch.arange(40)[None]
    with torch.no_grad():  # the written config.json carries the rotary scaling transformers needs
        torch.testing.assert_close(LlamaForCausalLM.from_pretrained(out)(tokens).logits, model.eval()(tokens),
                                   rtol=1e-5, atol=1e-5)


def test_lora_from_an_hf_directory_starts_at_the_base_model(token_data, tmp_path):
    """With model.init_from and LoRA the base loads before the adapters (B = 0): the first loss is transformers'."""
    from tests.support.hf import transformers_first_step
    from tests.support.jobs import tiny_spec
    from tests.support.reference import reference_run

    src = save_hf_llama(tmp_path / "hf", intermediate_size=64)
    spec = tiny_spec(token_data, tmp_path, model={"init_from": str(src), "lora": {"rank": 4}}, train={"steps": 1})
    assert spec.model.lora.targets == ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    losses, _ = reference_run(spec, 1)
    assert losses[0] == pytest.approx(transformers_first_step(spec, src)[0], rel=1e-5)


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _theta_at_top_level(c):
    c["rope_parameters"] = {"rope_type": "default"}


def _scaling_beside_parameters(c):
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    c["rope_scaling"] = {**_LLAMA3, "original_max_position_embeddings": 16}


def _scaling_without_original_length(c):
    c["rope_parameters"] = {**_LLAMA3}


@pytest.mark.parametrize("edit", [_theta_at_top_level, _scaling_beside_parameters, _scaling_without_original_length],
                         ids=["theta-top-level", "rope_scaling-wins", "llama3-no-original-length"])
def test_rope_spellings_of_config_json_resolve_as_in_transformers(tmp_path, edit):
    """Each way a config.json may spell the rotary settings gives transformers' logits: rope_theta from the top
    level when rope_parameters lacks it, rope_scaling over rope_parameters, a missing llama3
    original_max_position_embeddings taken from max_position_embeddings."""
    import json

    from transformers import LlamaForCausalLM

    src = save_hf_llama(tmp_path, rope_scaling=None)
    config = json.loads((src / hf_io.CONFIG).read_text())
    config.pop("rope_scaling", None)
    config["rope_theta"] = 500000.0
    edit(config)
    (src / hf_io.CONFIG).write_text(json.dumps(config))
    cfg = ModelConfig(**{**hf_io.config_fields(hf_io.read_config(src)), "seq_len": 64})
    ours = build_model(cfg)
    hf_io.load_hf_weights(ours, src)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(src).eval()(tokens).logits
        got = ours.eval()(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_llama3_rope_missing_a_factor_names_it():
    config = hf_llama(rope_scaling=None).config.to_dict()
    config["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}
    with pytest.raises(ValueError, match="lack low_freq_factor, high_freq_factor"):
        hf_io.config_fields(config)


def test_export_of_an_init_from_run_keeps_the_checkpoints_ids_context_and_files(token_data, tmp_path):
    """export-hf of a run that started from an HF directory: its bos/eos/pad ids and context length (not the
    job's seq_len), its tokenizer and generation files come along, and transformers reads the same model."""
    import json
    import warnings

    import torch.distributed.checkpoint as dcp
    from transformers import GenerationConfig, LlamaForCausalLM

    from tests.support.jobs import tiny_spec
    from workers.finetune import export_merged
    from workers.model.meta_init import build_full
    from workers.spec import WorkerSpec

    src = save_hf_llama(tmp_path / "hf", intermediate_size=64, bos_token_id=250, eos_token_id=[251, 252],
                        pad_token_id=253, max_position_embeddings=4096)
    GenerationConfig(bos_token_id=250, eos_token_id=[251, 252], max_new_tokens=7).save_pretrained(src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    worker = tiny_spec(token_data, tmp_path, model={"init_from": str(src)}).worker_dict()
    job = WorkerSpec.from_dict(worker)
    model = build_full(job.model, job.train.seed)
    hf_io.load_hf_weights(model, src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's warning about saving without a process group
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    out = export_merged(worker, tmp_path / "ckpt", tmp_path / "out", "hf")
    config, original = (json.loads((d / hf_io.CONFIG).read_text()) for d in (out, src))
    for key in hf_io.CARRIED_KEYS:
        assert config[key] == original[key], key
    assert config["max_position_embeddings"] == 4096  # not the job's seq_len 32
    for name in ("generation_config.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    exported = LlamaForCausalLM.from_pretrained(out)
    assert exported.generation_config.max_new_tokens == 7
    assert exported.model.embed_tokens.padding_idx == 253
    tokens = torch.arange(40)[None]
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, LlamaForCausalLM.from_pretrained(src)(tokens).logits,
                                   rtol=1e-5, atol=1e-5)


def test_a_merged_export_of_a_tied_model_with_an_adapted_head_gives_transformers_our_logits(tmp_path):
    """LoRA on a tied model's `output` makes the merged head another matrix than the embedding: the export is
    written untied (it used to drop the merged head and keep the tie, off by ~1 in the logits)."""
    from transformers import LlamaForCausalLM

    from workers.contract.sections import LoraSection
    from workers.model.lora import LoRALinear, apply_lora, merged_state_dict

    ours = raymesh_llama_from(hf_llama(tie_word_embeddings=True))
    apply_lora(ours, LoraSection(rank=4, alpha=8.0, targets=["output", "wq"]), 0)
    with torch.no_grad():  # trained adapters: B is no longer zero
        for layer in (m for m in ours.modules() if isinstance(m, LoRALinear)):
            layer.lora_b.weight.normal_(0.0, 0.1)
    out = hf_io.write_hf(merged_state_dict(ours), ours.cfg, tmp_path / "out")
    exported = LlamaForCausalLM.from_pretrained(out).eval()
    assert exported.config.tie_word_embeddings is False
    tokens = torch.arange(40)[None]
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5)


def test_a_pt_export_of_a_tied_model_with_an_adapted_head_is_refused_naming_the_targets(tmp_path):
    from orchestrator import JobSpec
    from orchestrator.errors import SpecError
    from orchestrator.spec.lora import export_merged_weights

    job = JobSpec.from_dict({"data": {"path": "d"}, "run_dir": str(tmp_path / "run"),
                             "model": {"arch": "llama", "d_model": 32, "n_heads": 4, "n_layers": 2,
                                       "tie_embeddings": True, "lora": {"targets": ["wq", "output"]}}})
    with pytest.raises(SpecError, match=r"`model.lora.targets`: value \['wq', 'output'\] adapts the output head.*"
                                        r"fix: export with --format hf"):
        export_merged_weights(job, None, str(tmp_path / "merged.pt"))


def test_an_hf_export_of_an_moe_llama_is_refused_naming_model_moe_before_the_checkpoint_is_read(tmp_path):
    """It used to read the whole checkpoint, then end on a KeyError naming a router weight, with no fix."""
    from orchestrator import JobSpec
    from orchestrator.errors import SpecError
    from orchestrator.spec.lora import export_hf_weights

    job = JobSpec.from_dict({"data": {"path": "d"}, "run_dir": str(tmp_path / "run"),
                             "model": {"arch": "llama", "d_model": 32, "n_heads": 4, "n_layers": 2,
                                       "moe": {"experts": 4}}})
    with pytest.raises(SpecError, match=r"`model.moe`: value .* has no Hugging Face layout in raymesh under "
                                        r"model.hf_model_type 'llama': its feed-forward is dense.*"
                                        r"fix: set model.hf_model_type: mixtral"):
        export_hf_weights(job, None, str(tmp_path / "hf"))
    mixtral = JobSpec.from_dict({**job.model_dump(mode="json", exclude_none=True),
                                 "model": {**job.model.model_dump(exclude_none=True), "hf_model_type": "mixtral"}})
    with pytest.raises(SpecError) as refused:  # past the layout check: there is no checkpoint to export yet
        export_hf_weights(mixtral, None, str(tmp_path / "hf"))
    assert "model.moe" not in str(refused.value)


def test_export_hf_of_a_tp_padded_vocabulary_writes_the_jobs_vocabulary(token_data, tmp_path):
    """A tp=4 run pads model.vocab_size 258 to 260 rows; `raymesh export-hf` writes the job's 258 (config.json,
    embedding, head), the tokenizer's size, and transformers' logits on real ids are raymesh's own (float32, CPU)."""
    import json
    import warnings

    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    from orchestrator.checkpoints import checksums
    from orchestrator.spec.lora import export_hf_weights
    from tests.support.jobs import tiny_spec
    from workers.model.meta_init import build_full
    from workers.spec import WorkerSpec

    spec = tiny_spec(token_data, tmp_path, model={"arch": "llama", "vocab_size": 258}, parallel={"tp": 4})
    assert spec.padded_vocab_size == 260
    job = WorkerSpec.from_dict(spec.worker_dict())
    model = build_full(job.model, job.train.seed).eval()
    ckpt = spec.checkpoint_dir() / "step-00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's warning about saving without a process group
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    checksums.write_manifest(ckpt)
    out = export_hf_weights(spec, str(ckpt), str(tmp_path / "out"))
    assert json.loads((out / hf_io.CONFIG).read_text())["vocab_size"] == 258
    exported = LlamaForCausalLM.from_pretrained(out).eval()
    assert exported.model.embed_tokens.weight.shape[0] == exported.lm_head.weight.shape[0] == 258
    tokens = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model(tokens)[..., :258], rtol=1e-4, atol=1e-4)
    again = tiny_spec(token_data, tmp_path, model={"init_from": str(out)}, parallel={"tp": 2})  # and back in
    reread = build_full(WorkerSpec.from_dict(again.worker_dict()).model, 0)
    hf_io.load_hf_weights(reread, out)
    assert torch.equal(reread.output.weight, model.output.weight[:258])
