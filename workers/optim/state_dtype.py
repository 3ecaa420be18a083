"""``optim.state_dtype: bf16``: Adam/AdamW whose two moments are stored in bfloat16, halving their bytes.

PyTorch's Adam and AdamW keep their moments in the parameter's dtype (float32 here), and their fused and foreach
kernels expect it. torchao's low-bit Adams carry the update that reads low-precision moments: each step upcasts
one parameter's moments to float32, updates them and the weight in float32, and rounds the moments back into
their stored dtype (``torchao.optim.adam.single_param_adam``; torchtitan's and DeepSpeed's bf16 states do the
same). torchao's own ``AdamW`` class is not used as such: it compiles that function per parameter (a C++
toolchain and minutes of inductor on a CPU rank) and needs a tensor learning rate, while raymesh's schedule and
resume set it as a float; the function runs as well eagerly, one parameter at a time (so only one parameter's
float32 moments exist at once), on plain tensors and DTensors alike.

The moments keep their dtype through every state path: ``torch.optim.Optimizer.load_state_dict`` casts loaded
state to the parameter's dtype, so ``load_state_dict`` here rounds them back (bf16 values survive float32 exactly,
so a resume is bit-identical), and DCP saves and reshards them as the bf16 tensors they are.
"""

from __future__ import annotations

import torch
from torchao.optim.adam import single_param_adam

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MOMENTS = ("exp_avg", "exp_avg_sq")


class LowPrecisionAdam(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay`` False) or AdamW with ``exp_avg``/``exp_avg_sq`` held in ``state_dtype``;
    the state keys are torch's, so checkpoints read like an AdamW's."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float = 0.0, eps: float = 1e-8,
                 decoupled_weight_decay: bool = True, state_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "eps": eps})
        self.decoupled = decoupled_weight_decay
        self.state_dtype = state_dtype

    def _state(self, p: torch.Tensor) -> dict:
        """``p``'s state, created on its first step: a float32 step count (torch's key) and zero moments."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            for key in MOMENTS:
                state[key] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient, in float32, the moments stored back rounded."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                single_param_adam(p, p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"], None,
                                  group["lr"], beta1, beta2, group["weight_decay"], group["eps"], self.decoupled,
                                  False)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the moments back in ``state_dtype`` (the base class cast them to the parameter's)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in MOMENTS:
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)
