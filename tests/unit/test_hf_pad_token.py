"""A Hugging Face checkpoint's ``pad_token_id``: its embedding row gets no gradient from the lookup, as with
transformers' ``padding_idx``, whole and with the embedding sharded over the vocabulary (tp=2, gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support.hf import save_hf_llama
from tests.support.parity_harness import rank_ports, spawn_ranks
from workers.model import hf_io
from workers.model.config import ModelConfig
from workers.model.registry import build_model
from workers.parallel.process_group import join_on_loopback

PAD = 5


def _tokens() -> torch.Tensor:
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    tokens[:, ::4] = PAD  # inputs and targets both hold the pad id
    return tokens


def _transformers_embedding_grad(src) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(src)
    tokens = _tokens()
    F.cross_entropy(ref(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return ref.model.embed_tokens.weight.grad


def _ours(src, tp_mesh=None, sequence_parallel=False):
    """raymesh's Llama from ``src``, tensor-parallel over ``tp_mesh`` when given, its weights loaded."""
    model = build_model(ModelConfig(**{**hf_io.config_fields(hf_io.read_config(src)), "seq_len": 32}))
    if tp_mesh is not None:
        from workers.parallel.llama_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh, sequence_parallel)
    hf_io.load_hf_weights(model, src)
    return model


def _embedding_grad(model) -> torch.Tensor:
    tokens = _tokens()
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grad = model.tok_embeddings.weight.grad
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pad_token_row_gets_transformers_gradient(tmp_path, tied):
    """Untied: the pad row's gradient is zero. Tied: only the head's share reaches it, as in transformers."""
    src = save_hf_llama(tmp_path, pad_token_id=PAD, tie_word_embeddings=tied, rope_scaling=None)
    expected = _transformers_embedding_grad(src)
    got = _embedding_grad(_ours(src))
    assert (expected[PAD].abs().max() == 0) == (not tied)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _rank_main(rank: int, ports, src: str, results) -> None:
    """One of two ranks: the embedding's full gradient with the vocabulary sharded over both, without and with
    sequence parallelism."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    port, listener = ports.join(rank, 0)
    join_on_loopback(rank, 2, port, listener=listener)
    try:
        mesh = init_device_mesh("cpu", (2,))
        results.put((rank, [_embedding_grad(_ours(src, mesh, sp)).tolist() for sp in (False, True)]))
    finally:
        dist.destroy_process_group()


def test_pad_token_row_gets_no_gradient_with_a_vocab_sharded_embedding(tmp_path):
    src = save_hf_llama(tmp_path, pad_token_id=PAD, rope_scaling=None)
    expected = _transformers_embedding_grad(src)
    assert expected[PAD].abs().max() == 0
    for rank, grads in spawn_ranks(_rank_main, (rank_ports(1), str(src)), 2, timeout_s=120).items():
        for sequence_parallel, got in zip((False, True), grads, strict=True):
            torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=rank, sp=sequence_parallel: f"rank {r}, sp={sp}: {m}")
