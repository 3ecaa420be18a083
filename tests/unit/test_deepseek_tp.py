"""DeepSeek-V3's tensor-parallel plan (``workers.parallel.deepseek_parallel``) on 2 gloo ranks, Ray-free: the split
model's logits and every parameter's gradient (DTensor shards gathered) equal the unsplit model's, with and without
sequence parallelism, with a low-rank query (``wq_b`` split) and without (``wq`` split), with LoRA adapters on every
MLA linear, a dense first block and an MoE block with shared experts; each rank holds the parameters the planner
counts for it. Gradients per parameter, not a loss curve: a replicated weight whose gradient missed its sum over tp
(the rotary key every head shares, the latents) would shift a training loss by less than 1e-6 on the tiny model, but
its gradient by far more."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.support.parity_harness import gloo_dp_mesh, rank_ports, spawn_ranks
from workers.model.registry import build_model, model_config

TP = 2
MODEL = {"arch": "deepseek_v3", "vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 48,
         "seq_len": 8, "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
         "v_head_dim": 6, "dense_layers": 1,
         "moe": {"experts": 4, "top_k": 2, "router": "sigmoid", "groups": 2, "top_groups": 1, "shared_experts": 2,
                 "d_expert": 16, "bias_balancing": True}}
LORA = ["wq_a", "wq_b", "wkv_a", "wkv_b", "wo"]  # every MLA linear adapted: replicated, column- and row-parallel bases
CASES = [(True, 16, False), (False, 16, False), (True, None, False), (True, 16, True)]  # (SP, q_lora_rank, LoRA)


def _gradients(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits of ``tokens`` and every parameter's (whole) gradient of their next-token loss."""
    logits = model(tokens)
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for name, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


def _check(mesh, sequence_parallel: bool, q_lora_rank: int | None, lora: bool) -> None:
    from workers.contract.sections import LoraSection
    from workers.model.lora import apply_lora, freeze_base
    from workers.parallel.deepseek_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    reference = build_model(model_config({**MODEL, "q_lora_rank": q_lora_rank}))
    if lora:  # adapters drawn non-zero, so every one of them changes the output
        apply_lora(reference, LoraSection(rank=4, targets=LORA), seed=0)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.1)
    split = copy.deepcopy(reference)
    apply_tensor_parallel(split, mesh, sequence_parallel)
    if lora:
        freeze_base(split)  # as the builder does after tp
    else:
        assert isinstance(split.layers["1"].attention.wkv_b.weight, DTensor)
        assert not isinstance(split.layers["1"].attention.wkv_a.weight, DTensor)  # the down projection: replicated
        assert split.layers["1"].feed_forward.shared.w1.to_local().shape[2] == MODEL["moe"]["d_expert"] // TP
        assert _held(split) == _planned(q_lora_rank)
    tokens = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_len"]), generator=torch.Generator().manual_seed(1))
    want_logits, want = _gradients(reference, tokens)
    got_logits, got = _gradients(split, tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-6)
    assert set(got) == set(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _held(model: torch.nn.Module) -> int:
    """Parameters this tp rank holds (a DTensor's local shard)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _planned(q_lora_rank: int | None) -> int:
    """The planner's parameters for one tp rank of the same model at tp=2 (sharded / tp + replicated + experts)."""
    from orchestrator import JobSpec
    from orchestrator.planning.estimate import stage_expert_params, stage_params

    spec = JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "parallel": {"tp": TP},
                              "model": {**MODEL, "q_lora_rank": q_lora_rank}})
    sharded, replicated = stage_params(spec, 0, 1)
    return sharded // TP + replicated + stage_expert_params(spec, 0, 1)


def _rank_main(rank: int, ports, world: int, results) -> None:
    import torch.distributed as dist

    mesh = gloo_dp_mesh(rank, ports, world)
    for case in CASES:
        _check(mesh, *case)
    dist.destroy_process_group()
    results.put((rank, "checked"))


def test_mla_split_by_heads_gives_the_unsplit_models_logits_and_gradients():
    assert spawn_ranks(_rank_main, (rank_ports(1), TP), TP, timeout_s=240) == dict.fromkeys(range(TP), "checked")
