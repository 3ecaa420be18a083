"""Tiny Hugging Face Llama checkpoints made locally with ``transformers`` (random weights, save_pretrained)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

# GQA (4 query heads over 2 K/V heads) and Llama-3 rotary scaling on; the original context is short so the
# scaling's three frequency bands all occur at head_dim 8
TINY_HF = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
           "rope_theta": 500000.0, "tie_word_embeddings": False,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 16}}


def hf_llama(seed: int = 0, **overrides):
    """A ``LlamaForCausalLM`` with random weights (std 0.1, so every layer matters to the logits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_HF, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


# the families raymesh reads beside Llama, each on the tiny shape: Qwen3 with heads wider than d_model/n_heads
# (head_dim 16 at d_model 32 over 4 heads) and tied embeddings, Qwen2 with its q/k/v biases, Mistral with no window;
# Qwen3-MoE with 8 experts (top-2, renormalised) in every other layer (1 and 3; 0 and 2 dense, 48 wide) 24 wide,
# Mixtral with 4 experts in every layer
TINY_FAMILIES = {
    "qwen3": {"head_dim": 16, "tie_word_embeddings": True},
    "qwen2": {},
    "mistral": {"head_dim": 8, "sliding_window": None},
    "qwen3_moe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "decoder_sparse_step": 2, "norm_topk_prob": True},
    "mixtral": {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
}


def hf_family(kind: str, seed: int = 0, **overrides):
    """A tiny ``AutoModelForCausalLM`` of family ``kind`` (``TINY_FAMILIES``), random weights as ``hf_llama``'s
    (biases drawn too, so they matter to the logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {k: v for k, v in TINY_HF.items() if k != "rope_scaling"}
    torch.manual_seed(seed)
    config = AutoConfig.for_model(kind, **{**shape, **TINY_FAMILIES[kind], **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 or name.endswith("bias") else p.uniform_(0.5, 1.5)
    return model


def save_hf_family(directory: Path, kind: str, seed: int = 0, **overrides) -> Path:
    """Write a tiny HF directory of family ``kind`` (``hf_family``)."""
    hf_family(kind, seed, **overrides).save_pretrained(directory)
    return Path(directory)


def raymesh_llama_from(hf_model, **fields):
    """raymesh's Llama with ``hf_model``'s shape (seq_len 64 unless ``fields`` says otherwise) and its weights, read
    from its ``save_pretrained`` directory (``transformers`` fuses an MoE's experts in memory, not on disk)."""
    from workers.model import hf_io
    from workers.model.config import ModelConfig
    from workers.model.registry import build_model

    cfg = ModelConfig(**{**hf_io.config_fields(hf_model.config.to_dict()), "seq_len": 64, **fields})
    model = build_model(cfg)
    with tempfile.TemporaryDirectory() as directory:  # read as init_from does: an MoE's experts are fused in memory
        hf_model.save_pretrained(directory)
        hf_io.load_hf_weights(model, directory)
    return model.eval()


def save_hf_llama(directory: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Write a tiny HF Llama directory (``max_shard_size`` small enough gives a sharded one with an index)."""
    model = hf_llama(seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return Path(directory)


def transformers_first_step(spec, hf_dir) -> tuple[float, float]:
    """Loss and global gradient norm of ``transformers``' model on the job's first global batch: what a
    raymesh layout loading ``hf_dir`` must report for its first step."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from workers.data import DataCursor, TokenDataset

    model = AutoModelForCausalLM.from_pretrained(hf_dir)  # float32, as saved; the class config.json names
    cursor = DataCursor(TokenDataset(spec.data.path, spec.model.seq_len, spec.data.seed),
                        spec.train.global_batch_size, dp_rank=0, dp_size=1)
    inputs, targets = cursor.next_batch()
    loss = F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten(0, 1))
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return loss.item(), norm.item()


# a GPT-2 (learned positions, LayerNorm, Conv1D projections, tied head) of the tiny job's shape, which raymesh has
# no family for: it trains as model.arch hf; dropout off, so a layout can match the single process
TINY_GPT2 = {"vocab_size": 256, "n_embd": 32, "n_layer": 4, "n_head": 4, "n_inner": 64, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}


def save_hf_gpt2(directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random ``GPT2LMHeadModel`` (``TINY_GPT2``) written by ``save_pretrained`` into ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **{**TINY_GPT2, **overrides}))
    model.save_pretrained(str(directory))
    return directory


def init_from_layouts(hf_dir, token_data, tmp_path_factory, layouts: dict, steps: int, model: dict | None = None):
    """Each layout's job over ``model.init_from: hf_dir`` (``model`` fields beside it), the checkpoint it writes
    after ``steps`` steps, and the runs (those of one size in one spawn, ``run_grouped``): (specs, written, runs)."""
    from tests.support.jobs import tiny_spec
    from tests.support.parity_harness import run_grouped

    specs, written = {}, {}
    for name, parallel in layouts.items():
        tmp = tmp_path_factory.mktemp(name)
        specs[name] = tiny_spec(token_data, tmp, parallel={**parallel, "device": "cpu"},
                                model={**(model or {}), "init_from": str(hf_dir)}, train={"steps": steps},
                                checkpoint={"dir": str(tmp / "ckpt")})
        written[name] = tmp / "ckpt" / f"step-{steps:08d}"
    return specs, written, run_grouped(specs, checkpoints={name: str(path) for name, path in written.items()})


def dcp_model_tensors(checkpoint, scratch) -> dict[str, torch.Tensor]:
    """The ``model`` entries of a DCP checkpoint, read by DCP's own converter (not raymesh's loader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(scratch))
    return torch.load(scratch, weights_only=False)["model"]


def assert_first_step_then_reference(run, spec, hf_dir, steps: int) -> None:
    """A layout ``run`` of ``spec`` (``init_from: hf_dir``): its first step's loss and gradient norm equal
    ``transformers``' own model's (1e-5), all ``steps`` the single-process reference's (1e-4)."""
    import pytest

    from tests.support.reference import reference_run

    loss, norm = transformers_first_step(spec, hf_dir)
    assert run.losses[0] == pytest.approx(loss, rel=1e-5)
    assert run.grad_norms[0] == pytest.approx(norm, rel=1e-5)
    losses, grad_norms = reference_run(spec, steps)
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)
def save_hf_deepseek(directory: Path, config: dict) -> tuple:
    """A tiny random ``DeepseekV3ForCausalLM`` of ``config`` (std 0.1, the routers' balancing biases drawn too, so
    they steer routing), saved to ``directory``; returns (model, directory)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    model.save_pretrained(directory)
    return model, Path(directory)


# gpt-oss of the tiny job's shape: 4 layers alternating a 6-token window and full attention, 4 query heads over 2 K/V
# heads of 8, 4 experts (top 2) 64 wide, YaRN x4 over 16 positions (its three bands all occur at head_dim 8), and a
# SwiGLU limit of 0.5 so the clamps act at these weights' scale
TINY_GPT_OSS = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 6, "max_position_embeddings": 64, "swiglu_limit": 0.5,
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 16,
                                    "rope_theta": 150000.0}}


def save_hf_gpt_oss(directory: Path, seed: int = 0, **overrides) -> tuple:
    """A tiny random ``GptOssForCausalLM`` (``TINY_GPT_OSS``; matrices std 0.1, biases and sinks std 0.3 so they
    matter, norms near one), eager attention, saved to ``directory``; returns (model, directory)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(**{**TINY_GPT_OSS, **overrides})
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return model, Path(directory)
