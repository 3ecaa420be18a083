"""DeepSeek-V3's decoding (``workers.model.generation`` over ``LatentAttention``) caches MLA's compressed form: per
token and layer the normed latent (kv_lora_rank) and the rotated shared key (qk_rope_head_dim), never the heads'
keys and values. On a tiny random ``DeepseekV3ForCausalLM``: every cached step's logits equal a full forward over
the whole context (kv_b absorbed into the query and output, and, for a wrapped up projection, expanded from the
cache each step); greedy tokens equal the uncached loop's and ``transformers``' ``generate``; the cache holds
exactly (kv_lora_rank + rope) x layers x 4 bytes (fp32) per token and sequence."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.support.hf import save_hf_deepseek
from workers.model import hf_io
from workers.model.generation import KVCache, Sampling, generate
from workers.model.registry import build_model, model_config

HF = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
      "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
      "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
      "max_position_embeddings": 64, "routed_scaling_factor": 2.5}
PROMPT = [5, 17, 99, 3, 64, 21, 8]
NEW = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers' model, ours read from its checkpoint by ``load_hf_weights``), both in eval mode."""
    directory = tmp_path_factory.mktemp("deepseek-gen") / "hf"
    hf, _ = save_hf_deepseek(directory, HF)
    fields = hf_io.config_fields(hf_io.read_config(directory))
    ours = build_model(model_config({**fields, "seq_len": 64}))
    hf_io.load_hf_weights(ours, directory)
    return hf.eval(), ours.eval()


def _uncached_greedy(model: nn.Module, prompt: list[int], new: int) -> list[int]:
    """Greedy ids by a full forward over the whole context each step (no cache)."""
    context = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new):
            context = torch.cat((context, model(context)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return context[0, len(prompt):].tolist()


@pytest.mark.parametrize("wrapped", [False, True], ids=["absorbed", "expanded"])
def test_each_cached_step_gives_the_full_forwards_logits(models, wrapped):
    _, ours = models
    decoder = copy.deepcopy(ours)  # the cache sits on this one; ``ours`` runs the full forwards
    if wrapped:  # an up projection that is no plain Linear (as LoRA wraps it): the cached latent is expanded
        for block in decoder.layers.values():
            block.attention.wkv_b = nn.Sequential(block.attention.wkv_b)
    context = torch.tensor([PROMPT, PROMPT[::-1]])
    cache = KVCache(decoder)
    with torch.no_grad():
        logits = cache.forward(context)
        for _ in range(6):
            torch.testing.assert_close(logits, ours(context)[:, -logits.shape[1]:], rtol=1e-5, atol=1e-5)
            step = logits[:, -1].argmax(-1, keepdim=True)
            context = torch.cat((context, step), dim=1)
            logits = cache.forward(step)
    cache.close()


def test_greedy_tokens_equal_the_uncached_loop_and_transformers_generate(models):
    hf, ours = models
    tokens = generate(ours, PROMPT, NEW, Sampling(temperature=0.0, top_k=0), window=64)[0]
    assert tokens == _uncached_greedy(ours, PROMPT, NEW)
    hf.generation_config.eos_token_id = None  # no early stop: NEW tokens, as ours
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                          pad_token_id=0)
    assert tokens == out[0, len(PROMPT):].tolist()


def test_the_cache_holds_the_latent_and_the_rotary_key_per_token_and_layer(models):
    _, ours = models
    cfg = ours.cfg
    cache = KVCache(ours)
    with torch.no_grad():
        cache.forward(torch.tensor([PROMPT, PROMPT]))
        cache.forward(torch.tensor([[1], [2]]))
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.n_layers * 4  # fp32
    assert cache.nbytes == 2 * cache.length * per_token
    cache.close()
