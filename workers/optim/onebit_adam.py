"""1-bit Adam (Tang et al. 2021): Adam's momentum crosses data parallelism as signs once the variance is frozen.

Why our own: neither PyTorch nor any library raymesh uses has it (DeepSpeed's needs its engine).
For ``warmup_steps`` steps this is AdamW on gradients the ZeRO-0 buckets averaged in full precision. After
that the second moment v is frozen, the buckets stay silent (``communicates``: the trainer pauses them), and
each rank folds its *own* gradient into its momentum, adds the error it kept from the last step, and sends
only the sign of every entry plus one scale per tensor (‖x‖₂/√n, so the compressed tensor has x's norm): 1
bit per parameter instead of 32. The ranks all-gather the packed signs and scales and every rank averages
them into the same momentum, so the weights stay identical everywhere; what compression dropped stays in the
rank's error for the next step (error feedback). The paper's second, server-side compression stage is left
out: with an all-gather every rank decompresses the same average, so there is no server error to carry.

The step counter and both moments live in the optimizer state: the same on every rank, so a checkpoint's one
copy serves all replicas. The error is each rank's own, so it lives outside, in ``feedback`` (per parameter),
which the trainer hands to snapshots and checkpoints under the rank's name
(``workers.state.compression_feedback``), as it does PowerSGD's and top-k's. It is keyed by the parameter's
global name (``ParameterErrors``), not its position in the optimizer: a resume whose param groups differ
(``optim.weight_decay_exclude`` puts the 1-D parameters in a group of their own) would otherwise hand one
parameter's error to another of the same shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.model.names import plain_name

_BITS = 8


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """1 bit per entry of ``x`` (set where x >= 0), eight to a byte."""
    bits = (x.reshape(-1) >= 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % _BITS)).view(-1, _BITS)
    return (bits << torch.arange(_BITS, dtype=torch.uint8, device=x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """±1.0 per entry, the inverse of ``pack_signs`` for its first ``n`` entries."""
    bits = (packed[:, None] >> torch.arange(_BITS, dtype=torch.uint8, device=packed.device)) & 1
    return bits.reshape(-1)[:n].float() * 2 - 1


class OneBitAdam(torch.optim.Optimizer):
    """AdamW, then sign-compressed momentum with error feedback after ``warmup_steps`` (module docstring)."""

    def __init__(self, params, group=None, warmup_steps: int = 1, lr: float = 1e-3, betas=(0.9, 0.999),
                 weight_decay: float = 0.0, eps: float = 1e-8, names: dict[int, str] | None = None):
        """``names``: each parameter's global name by ``id``, in the model's order (its error's key; the order is
        what older checkpoints' positions are read by); without them (a bare optimizer, as in tests) its
        position in the param groups."""
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "eps": eps})
        self.group, self.warmup_steps = group, warmup_steps
        if names is None:
            names = {id(p): str(i) for i, p in enumerate(_in_order(self.param_groups))}
        self.name_of = {i: plain_name(n) for i, n in names.items()}  # in the model's order
        self.feedback = ParameterErrors(self)  # this rank's error per parameter name, see the module docstring

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters with a gradient, each with its name (its error's key)."""
        return [(self.name_of[id(p)], p) for p in _in_order(self.param_groups) if p.grad is not None]

    def step_order(self) -> list[str]:
        """Every parameter's name in the order the param groups hold them (what older checkpoints keyed by)."""
        return [self.name_of[id(p)] for p in _in_order(self.param_groups)]

    @property
    def steps_done(self) -> int:
        first = next((self.state[p] for g in self.param_groups for p in g["params"] if self.state[p]), None)
        return int(first["step"]) if first else 0

    @property
    def communicates(self) -> bool:
        """Whether this step's gradients stay local: the compressed momentum is what crosses the group."""
        return self.steps_done >= self.warmup_steps

    @torch.no_grad()
    def step(self, closure=None):
        compressing = self.communicates
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                st["step"] += 1
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                if not compressing:
                    st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        if compressing:
            self._average_compressed_momentum()
        for group in self.param_groups:
            self._update(group)

    def _update(self, group: dict) -> None:
        """AdamW's update from the (averaged) momentum and the (frozen after warm-up) second moment."""
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            t = int(st["step"])
            v_steps = min(t, self.warmup_steps)
            denom = (st["exp_avg_sq"] / (1 - b2 ** v_steps)).sqrt_().add_(group["eps"])
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(st["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))

    def _average_compressed_momentum(self) -> None:
        """Signs + scales of every momentum (with its error added), all-gathered in one uint8 buffer, averaged."""
        indexed = self._params()
        params, errors = [p for _, p in indexed], self.feedback.errors
        shipped, scales = [], []
        for name, p in indexed:
            x = self.state[p]["exp_avg"] + errors.get(name, 0.0)
            scale = x.norm() / x.numel() ** 0.5
            errors[name] = x - torch.where(x >= 0, scale, -scale)
            shipped.append(pack_signs(x))
            scales.append(scale.float().reshape(1))
        payload = torch.cat([*shipped, torch.cat(scales).view(torch.uint8)])
        world = dist.get_world_size(self.group) if self.group is not None else 1
        gathered = [torch.empty_like(payload) for _ in range(world)]
        if world > 1:
            dist.all_gather(gathered, payload, group=self.group)
        else:
            gathered = [payload]
        for p in params:
            self.state[p]["exp_avg"].zero_()
        for buf in gathered:
            # a copy: the sign bytes before them need not add up to a multiple of 4, and a float32 view must start
            # at an aligned offset
            rank_scales = buf[-4 * len(params):].clone().view(torch.float32)
            offset = 0
            for p, packed, scale in zip(params, shipped, rank_scales):
                signs = unpack_signs(buf[offset:offset + packed.numel()], p.numel()).view_as(p)
                self.state[p]["exp_avg"].add_(signs.to(p.dtype) * scale / world)
                offset += packed.numel()


def _in_order(param_groups: list[dict]) -> list[torch.Tensor]:
    """The parameters of ``param_groups``, group after group."""
    return [p for g in param_groups for p in g["params"]]


class ParameterErrors:
    """1-bit Adam's error per parameter name (``errors``) as a ``state_dict`` of CPU copies, for snapshots and
    checkpoints (``workers.state.compression_feedback``). Checkpoints of older versions keyed it by position
    in the param groups (``OLD``); ``upgrade`` reads those by the order the saved param groups held them."""

    KEY, OLD = "named_error.", "error."

    def __init__(self, optimizer: OneBitAdam):
        self.optimizer = optimizer
        self.errors: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {self.KEY + n: e.detach().to("cpu", copy=True) for n, e in self.errors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> None:
        self.errors = {k[len(self.KEY):]: t.to(device, copy=True) for k, t in state.items() if k.startswith(self.KEY)}

    def upgrade(self, state: dict[str, torch.Tensor], saved_decay: dict[str, float], checkpoint: str) -> dict:
        """``state`` keyed by name. A position-keyed one (an older save) is read by the order the checkpoint's
        param groups held the parameters, rebuilt exactly from each one's ``saved_decay`` as ``decay_groups``
        built them (``_saved_order``), so it resumes under any ``optim.weight_decay_exclude``. Refused, naming
        ``checkpoint``, why and the fix, only where no order can be rebuilt: the checkpoint lacks some parameter's
        group settings, or a position is past this job's parameters or holds another shape (another model)."""
        old = {int(k[len(self.OLD):]): t for k, t in state.items() if k.startswith(self.OLD)}
        if not old:
            return state
        shapes = {self.optimizer.name_of[id(p)]: p.shape for p in _in_order(self.optimizer.param_groups)}
        saved = _saved_order(list(self.optimizer.name_of.values()), saved_decay)
        why = _unmappable(old, saved, shapes)
        if why:
            raise ValueError(_old_order_refusal(checkpoint, why))
        return {self.KEY + saved[i]: t for i, t in old.items()}


def _saved_order(model_order: list[str], saved_decay: dict[str, float]) -> list[str] | None:
    """The parameters in the order a save's param groups held them (one group per weight decay, in the order
    each decay first occurs along the model, as ``workers.optim.build.decay_groups`` builds them and, before it,
    one group); None when the checkpoint lacks a parameter's group settings."""
    if any(n not in saved_decay for n in model_order):
        return None
    first: dict[float, int] = {}
    for n in model_order:
        first.setdefault(saved_decay[n], len(first))
    return sorted(model_order, key=lambda n: first[saved_decay[n]])


def _unmappable(old: dict[int, torch.Tensor], saved: list[str] | None, shapes: dict[str, torch.Size]) -> str:
    """Why the position-keyed errors ``old`` cannot be read in the ``saved`` order of parameters (of ``shapes``
    in this job), or "" where they can."""
    if saved is None:
        return "it has no param-group settings for some of this job's parameters"
    for i, t in sorted(old.items()):
        if i >= len(saved):
            return f"it holds an error at position {i}, past this job's {len(saved)} parameters"
        if t.shape != shapes[saved[i]]:
            return (f"its error at position {i} has shape {tuple(t.shape)}, where this job's parameter there, "
                    f"{saved[i]}, has {tuple(shapes[saved[i]])}")
    return ""


def _old_order_refusal(checkpoint: str, why: str) -> str:
    """The one-line refusal of a position-keyed error feedback whose positions cannot be mapped to names."""
    return (f"checkpoint {checkpoint} keeps 1-bit Adam's error feedback by parameter position, as raymesh did before "
            f"keying it by name, and {why}, so its positions cannot be read as this model's parameters; fix: resume "
            "it with the model it was saved with (its next save keys the errors by name), or start a fresh run in "
            "another run_dir or checkpoint.dir")
