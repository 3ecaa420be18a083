"""The offloaded Adam copies the next parameter's gradient to the host before the current parameter's host step
(``workers.offload.grad_pipeline``): the recorded order shows each copy started ahead of the step before it, and
the steps are bit-identical to PyTorch's fused AdamW over fp32 masters (what the offloaded step computed before).
CPU only: bf16 gradients take the background thread's cast, fp32 ones need no copy. No timing."""

from __future__ import annotations

import torch

from workers.offload.grad_pipeline import GradPipeline
from workers.offload.optimizer import OffloadedAdam
from workers.offload.store import OffloadStore

LR, WD = 1e-2, 0.1


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(dtype)


def _grads(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def test_each_gradient_copy_starts_before_the_step_ahead_of_it():
    model = _model(torch.bfloat16)
    opt = OffloadedAdam(model.parameters(), OffloadStore("cpu"), lr=LR)
    order: list = []
    opt._grads.trace = order
    _grads(model, 0)
    opt.step()
    n = len(list(model.parameters()))
    expected = [("copy", 0)] + [e for i in range(n) for e in ([("copy", i + 1)] if i + 1 < n else []) + [("step", i)]]
    assert order == expected
    assert order.index(("copy", 1)) < order.index(("step", 0))  # overlap: the next copy is in flight during a step


def test_offloaded_steps_stay_bit_identical_to_fused_adamw_over_fp32_masters():
    model, reference = _model(torch.bfloat16), _model(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in reference.parameters()]
    opt = OffloadedAdam(model.parameters(), OffloadStore("cpu"), lr=LR, weight_decay=WD)
    fused = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, betas=(0.9, 0.999), fused=True)
    for step in range(3):
        _grads(model, step)
        _grads(reference, step)
        for master, p in zip(masters, reference.parameters()):
            master.grad = p.grad.float()
        opt.step()
        fused.step()
        for master, p in zip(masters, model.parameters()):
            assert torch.equal(p.detach(), master.detach().to(torch.bfloat16))


def test_the_pipeline_hands_back_the_same_values_in_order():
    pipeline, order = GradPipeline(), []
    pipeline.trace = order
    grads = [torch.randn(5).bfloat16(), torch.randn(3), torch.randn(2, 2).bfloat16()]
    for i, grad in enumerate(grads):
        pipeline.start(i, grad)
    taken = [pipeline.take(i) for i in range(len(grads))]
    assert all(t.dtype == torch.float32 and torch.equal(t, g.float()) for t, g in zip(taken, grads))
    assert taken[1] is grads[1]  # an fp32 host gradient is read in place
    assert order == [("copy", 0), ("copy", 1), ("copy", 2), ("step", 0), ("step", 1), ("step", 2)]
