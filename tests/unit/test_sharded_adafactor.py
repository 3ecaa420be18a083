"""Adafactor on sharded parameters (workers/optim/adafactor.py) equals one process's ``torch.optim.Adafactor``.

Two levels, both without Ray:

* the optimizer alone, on 2 spawned gloo ranks: matrices sharded by rows, by columns (evenly, unevenly, and with
  an empty shard), a 3-D tensor sharded along its leading dimension, and a sharded vector, each stepped 3 times
  with weight decay and compared with PyTorch's Adafactor on the whole tensor (1e-6); PyTorch's own Adafactor
  stepping the local shards is shown to be wrong there (what the row/column all-reduces fix), and the factored
  state reads back as PyTorch's whole ``row_var``/``col_var`` (what DCP saves);
* the trainer, through the parity harness: a tiny model trained at ZeRO-1, ZeRO-2 and ZeRO-3 over dp=2 and at
  tp=2 follows the single-process curve with PyTorch's Adafactor (1e-4).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import gloo_dp_mesh, rank_ports, run_layouts, spawn_ranks
from tests.support.reference import reference_run

STEPS = 3
HYPER = {"lr": 0.05, "weight_decay": 0.1}
CASES = {  # name: (global shape, the sharded tensor dimension)
    "rows": ((6, 5), 0), "cols": ((4, 6), 1), "uneven-rows": ((5, 3), 0), "uneven-cols": ((3, 5), 1),
    "empty-shard": ((1, 4), 0), "stacked": ((2, 3, 4), 0), "stacked-cols": ((2, 3, 4), 2), "vector": ((7,), 0),
}
ON_LOCAL = ["rows", "cols", "stacked-cols", "vector"]  # the cases also stepped the wrong way (``_local_torch``)


def _data(shape: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A parameter and one gradient per step, the same on every rank (a fixed seed per shape)."""
    gen = torch.Generator().manual_seed(sum(shape) * 31 + len(shape))
    return torch.randn(shape, generator=gen), [torch.randn(shape, generator=gen) for _ in range(STEPS)]


def _whole(shape: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
    """The tensor after ``STEPS`` steps of PyTorch's Adafactor on one process, and its state."""
    value, grads = _data(shape)
    param = torch.nn.Parameter(value.clone())
    opt = torch.optim.Adafactor([param], foreach=False, **HYPER)
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    return param.detach(), opt.state[param]


def _sharded(shape, dim, mesh, optimizer) -> tuple[torch.Tensor, dict]:
    """The whole tensor and its state after ``STEPS`` steps of ``optimizer`` on the parameter sharded along
    ``dim`` over ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    value, grads = _data(shape)
    param = torch.nn.Parameter(distribute_tensor(value.clone(), mesh, [Shard(dim)]))
    opt = optimizer([param])
    for grad in grads:
        param.grad = distribute_tensor(grad.clone(), mesh, [Shard(dim)])
        opt.step()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in opt.state[param].items()}
    # as numpy arrays: a tensor would cross the results queue as a shared-memory handle of a rank that has exited
    return param.detach().full_tensor().numpy(), {k: v.numpy() for k, v in state.items()}


def _local_torch(params):
    """PyTorch's Adafactor stepping each rank's local shard as if it were the whole tensor (the wrong way)."""
    from torch.distributed.tensor import DTensor

    class OnLocal(torch.optim.Optimizer):
        def __init__(self, params):
            self.params = list(params)
            super().__init__(self.params, {})
            self.inner = None

        def step(self):
            if self.inner is None:
                self.locals = [torch.nn.Parameter(p.to_local()) for p in self.params]
                self.inner = torch.optim.Adafactor(self.locals, foreach=False, **HYPER)
            for p, local in zip(self.params, self.locals, strict=True):
                local.grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            self.inner.step()
            with torch.no_grad():
                for p, local in zip(self.params, self.locals, strict=True):
                    p.to_local().copy_(local)

    return OnLocal(params)


def _rank_main(rank: int, ports, results) -> None:
    """Every case stepped by the sharded Adafactor and by PyTorch's on the local shards, over dp=2."""
    from workers.optim.adafactor import ShardedAdafactor

    mesh = gloo_dp_mesh(rank, ports, 2)
    out = {}
    for name, (shape, dim) in CASES.items():
        out[name] = {"sharded": _sharded(shape, dim, mesh, lambda ps: ShardedAdafactor(ps, **HYPER))}
        if name in ON_LOCAL:  # (PyTorch's divides by zero on an empty shard)
            out[name]["local"] = _sharded(shape, dim, mesh, _local_torch)[0]
    dist.destroy_process_group()
    results.put((rank, out))


@pytest.fixture(scope="module")
def stepped():
    return spawn_ranks(_rank_main, (rank_ports(1),), 2, timeout_s=180)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_step_equals_one_process(name, stepped):
    shape, _ = CASES[name]
    whole, state = _whole(shape)
    for rank in (0, 1):
        value, got = stepped[rank][name]["sharded"]
        value, got = torch.from_numpy(value), {k: torch.from_numpy(v) for k, v in got.items()}
        assert torch.allclose(value, whole, rtol=1e-6, atol=1e-7), (rank, (value - whole).abs().max())
        for key in ("row_var", "col_var", "variance"):
            if key in state:
                assert got[key].shape == state[key].shape
                assert torch.allclose(got[key], state[key], rtol=1e-6, atol=1e-9), (rank, key)
        assert float(got["step"]) == STEPS


@pytest.mark.parametrize("name", ON_LOCAL)
def test_torch_adafactor_on_local_shards_is_not_one_process(name, stepped):
    """What the all-reduces are for: each shard's own statistics (row means of half the columns, the shard's RMS)
    move the parameter elsewhere."""
    whole, _ = _whole(CASES[name][0])
    assert not torch.allclose(torch.from_numpy(stepped[0][name]["local"]), whole, rtol=1e-4, atol=1e-6)


LAYOUTS = {"zero1": {"dp": 2, "zero": 1}, "zero2": {"dp": 2, "zero": 2}, "zero3": {"dp": 2, "zero": 3},
           "tp2": {"tp": 2}}


def _spec(token_data, tmp_path, parallel: dict):
    return tiny_spec(token_data, tmp_path, optim={"name": "adafactor", "lr": 0.01, "weight_decay": 0.1},
                     parallel={**parallel, "device": "cpu"}, train={"steps": STEPS, "microbatches": 1})


@pytest.fixture(scope="module")
def layouts(token_data, tmp_path_factory):
    """Each layout's run, then ZeRO-3's state saved after 2 steps and resumed at ZeRO-1 and at tp=2 for 2 more
    (DCP reshards the factored state, saved under its global shapes), all in one spawn of 2 ranks."""
    tmp = tmp_path_factory.mktemp("adafactor")
    specs = [_spec(token_data, tmp / n, p).worker_dict() for n, p in LAYOUTS.items()]
    saved = str(tmp / "zero3-saved")
    specs += [_spec(token_data, tmp / "s", LAYOUTS["zero3"]).worker_dict(),
              *(_spec(token_data, tmp / n, LAYOUTS[n]).worker_dict() for n in RESUMED_AT)]
    runs = run_layouts(specs, 2, [STEPS] * len(LAYOUTS) + [2] * (1 + len(RESUMED_AT)),
                       checkpoints=[None] * len(LAYOUTS) + [saved] + [None] * len(RESUMED_AT),
                       resumes=[None] * (len(LAYOUTS) + 1) + [saved] * len(RESUMED_AT))
    return dict(zip([*LAYOUTS, "saved", *(f"resumed-{n}" for n in RESUMED_AT)], runs, strict=True))


RESUMED_AT = ["zero1", "tp2"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_layouts_train_on_the_single_process_curve(name, layouts, token_data, tmp_path):
    losses, grad_norms = reference_run(_spec(token_data, tmp_path, {}), STEPS)
    assert layouts[name].losses == pytest.approx(losses, rel=1e-4)
    assert layouts[name].grad_norms == pytest.approx(grad_norms, rel=1e-4)
    assert losses[-1] < losses[0]  # it trains


@pytest.mark.parametrize("name", RESUMED_AT)
def test_zero3_state_resumes_at_another_layout_on_the_uninterrupted_curve(name, layouts, token_data, tmp_path):
    spec = tiny_spec(token_data, tmp_path, optim={"name": "adafactor", "lr": 0.01, "weight_decay": 0.1},
                     train={"steps": 4, "microbatches": 1})
    losses, _ = reference_run(spec, 4)
    assert layouts["saved"].losses + layouts[f"resumed-{name}"].losses == pytest.approx(losses, rel=1e-4)
