"""`optim.weight_decay_exclude`: under `1d` (the default) one optimizer step moves a 1-D parameter (norm weight,
bias) by exactly the update without weight decay and a matrix by the decayed one, on every optimizer path: the
torch optimizers under each `optim.implementation`, sm3, onebit_adam, the offloaded Adam, ZeRO-1's slices and
FSDP2's shards (2 spawned gloo ranks), and the parameter-server shards; a checkpoint saved with every parameter
in one group resumes into the two."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from orchestrator.errors import SpecError
from orchestrator.spec.job import JobSpec
from parameter_server import checkpoint
from parameter_server.client import PSClient
from parameter_server.ring import HashRing
from parameter_server.shard import PSShard
from tests.support.one_rank import one_rank_trainer
from tests.support.parity_harness import rank_ports, spawn_ranks
from tests.support.ps_local import LocalConn
from workers.contract.sections import OffloadSection, OptimSection
from workers.optim.build import build_optimizer

WD = 0.5
OPTIM = {"lr": 0.1, "weight_decay": WD, "weight_decay_exclude": "1d", "betas": [0.9, 0.95], "momentum": 0.9,
         "warmup_steps": 1}


def _params() -> dict[str, nn.Parameter]:
    """A matrix, a bias and a norm weight, each with a gradient."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": nn.Parameter(torch.randn(4, 3, generator=gen)), "b": nn.Parameter(torch.randn(4, generator=gen)),
              "norm": nn.Parameter(torch.ones(3))}
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def _stepped(optim: dict, offload: OffloadSection | None = None) -> dict[str, torch.Tensor]:
    """Each of ``_params()`` after one step of the job's optimizer over all of them."""
    params = _params()
    build_optimizer(params.values(), OptimSection(**optim), offload).step()
    return {n: p.detach() for n, p in params.items()}


def _alone(name: str, decay: float, optim: dict, offload: OffloadSection | None = None) -> torch.Tensor:
    """Parameter ``name`` after one step of the same optimizer holding it alone, with weight decay ``decay``."""
    param = _params()[name]
    alone = OptimSection(**{**optim, "weight_decay": decay, "weight_decay_exclude": "none"})
    build_optimizer([param], alone, offload).step()
    return param.detach()


OFFLOAD = OffloadSection(optimizer=True, tier="cpu")
PATHS = {  # id: (optim fields, memory.offload)
    **{f"{n}-{i}": ({"name": n, "implementation": i}, None) for n in ("adamw", "adam", "sgd")
       for i in ("fused", "foreach", "for_loop")},
    "adafactor": ({"name": "adafactor"}, None), "sm3": ({"name": "sm3"}, None),
    "onebit_adam": ({"name": "onebit_adam"}, None), "paged_adamw": ({"name": "paged_adamw"}, OFFLOAD),
    "adam-offloaded": ({"name": "adam"}, OFFLOAD),
}


@pytest.mark.parametrize("path", PATHS)
def test_one_step_spares_the_1d_parameters_and_decays_the_matrix(path):
    fields, memory = PATHS[path]
    optim = {**OPTIM, **fields}
    stepped = _stepped(optim, memory)
    assert torch.equal(stepped["w"], _alone("w", WD, optim, memory))
    assert not torch.equal(stepped["w"], _alone("w", 0.0, optim, memory))  # the decay shows in one step
    for name in ("b", "norm"):
        assert torch.equal(stepped[name], _alone(name, 0.0, optim, memory))
    everything = _stepped({**optim, "weight_decay_exclude": "none"}, memory)
    assert torch.equal(everything["b"], _alone("b", WD, optim, memory))  # `none`: every parameter decays, as before


def test_the_parameter_server_shards_spare_the_1d_chunks():
    """The shards step flat chunks (here of 5 elements, over 2 shards), so the rule reads the layout the ranks'
    client registers with them."""
    params, optim = _params(), {**OPTIM, "name": "adamw"}
    shards = [PSShard(i, "bsp", optim, workers=1, lrs=[optim["lr"]]) for i in range(2)]
    client = PSClient([LocalConn(s) for s in shards], 5, 16, worker=0)
    client.register({n: p.detach() for n, p in params.items()})
    client.push(0, {n: p.grad for n, p in params.items()})
    client.apply(0, 1.0)
    pulled = client.pull(list(params), 1)
    alone = {**optim, "implementation": "for_loop"}  # the shards' single-tensor AdamW
    assert torch.equal(pulled["w"], _alone("w", WD, alone))
    assert torch.equal(pulled["b"], _alone("b", 0.0, alone)) and torch.equal(pulled["norm"], _alone("norm", 0.0, alone))
    flat = checkpoint.whole([s.state() for s in shards], 5, {"workers": 1, "version": 1, "applied_from": [0]})
    resumed = [PSShard(i, "bsp", optim, workers=1, lrs=[optim["lr"]]) for i in range(2)]
    for shard, state in zip(resumed, checkpoint.shard_states(flat, HashRing(2, 16), 5, optim)):
        shard.restore({**state, "version": 1, "applied_from": [0]})
    decays = {k: o.param_groups[0]["weight_decay"] for s in resumed for k, o in s.opts.items()}
    assert decays == {k: WD if k.startswith("w#") else 0.0 for k in decays} and len(decays) == 5  # 3 + 1 + 1 chunks
    with pytest.raises(ValueError, match=r"register of key 'x#0' without its tensor's layout .*weight_decay_exclude"):
        PSShard(2, "bsp", optim, workers=1, lrs=[0.1]).register({"x#0": torch.zeros(3)})


def _rank_main(rank: int, ports, results) -> None:
    """ZeRO-1's row slices and FSDP2's shards of a bias-carrying Linear over dp=2: each in its parameter's group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from workers.parallel.distributed_optimizer import DistributedOptimizer
    from workers.parallel.process_group import join_on_loopback

    torch.set_num_threads(1)
    port, listener = ports.join(rank, 0)
    join_on_loopback(rank, 2, port, listener=listener)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    zero1 = DistributedOptimizer(nn.Linear(3, 4).named_parameters(), mesh, "dp")
    fsdp = fully_shard(nn.Linear(3, 4), mesh=mesh)
    seen = {}
    for kind, named in (("zero1", zero1.shards.items()), ("fsdp2", fsdp.named_parameters())):
        named = dict(named)
        opt = build_optimizer(named.values(), OptimSection(**OPTIM, name="adamw"))
        decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
        seen[kind] = {n: decay[id(p)] for n, p in named.items()}
        before = {n: p.to_local().detach().clone() for n, p in named.items()}
        for p in named.values():
            p.grad = torch.ones_like(p)
        opt.step()
        for n, p in named.items():  # the local rows moved as AdamW moves them alone at that decay
            alone = nn.Parameter(before[n])
            alone.grad = torch.ones_like(alone)
            torch.optim.AdamW([alone], lr=OPTIM["lr"], betas=(0.9, 0.95), weight_decay=seen[kind][n]).step()
            assert torch.allclose(p.to_local(), alone, rtol=0, atol=1e-7), (kind, n)
    dist.destroy_process_group()
    results.put((rank, seen))


def test_zero1_slices_and_fsdp2_shards_keep_their_parameters_group():
    by_rank = spawn_ranks(_rank_main, (rank_ports(1),), 2, timeout_s=120)
    assert by_rank[0] == by_rank[1] == {kind: {"weight": WD, "bias": 0.0} for kind in ("zero1", "fsdp2")}


def test_a_checkpoint_saved_with_one_group_resumes_into_two(tmp_path_factory, tmp_path):
    """A checkpoint saved before the rule (every parameter in one group, as `none` builds) resumes under `1d`: DCP
    keys the groups' settings per parameter, and the job's decay wins for each (``TrainState.load_state_dict``)."""
    optim = {"lr": 1e-3, "weight_decay": 0.1}
    with one_rank_trainer(tmp_path_factory, optim={**optim, "weight_decay_exclude": "none"}) as t:
        assert len(t.state.optimizers[0].param_groups) == 1
        t.train_step()
        t.checkpoints.save(tmp_path / "ckpt", async_save=False)
        saved = {n: p.detach().clone() for n, p in t.parts.modules[0].named_parameters()}
    with one_rank_trainer(tmp_path_factory, optim=optim) as t:
        t.checkpoints.load(tmp_path / "ckpt")
        opt, model = t.state.optimizers[0], t.parts.modules[0]
        assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.1]
        decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
        assert {n: decay[id(p)] for n, p in model.named_parameters()} == {
            n: 0.1 if p.dim() >= 2 else 0.0 for n, p in model.named_parameters()}
        assert all(float(s["step"]) == 1 for s in opt.state.values()) and len(opt.state) == len(saved)
        assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
        t.train_step()


def test_a_checkpoint_saved_with_two_groups_resumes_into_one(tmp_path_factory, tmp_path):
    """The reverse (README): saved under `1d`, resumed under `none`, every parameter decays at the job's rate."""
    optim = {"lr": 1e-3, "weight_decay": 0.1}
    with one_rank_trainer(tmp_path_factory, optim=optim) as t:
        t.train_step()
        t.checkpoints.save(tmp_path / "ckpt", async_save=False)
    with one_rank_trainer(tmp_path_factory, optim={**optim, "weight_decay_exclude": "none"}) as t:
        t.checkpoints.load(tmp_path / "ckpt")
        opt = t.state.optimizers[0]
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1]
        assert len(opt.state) == len(opt.param_groups[0]["params"])
        assert all(float(s["step"]) == 1 for s in opt.state.values())
        t.train_step()


def test_an_exclusion_without_weight_decay_is_refused():
    with pytest.raises(SpecError, match=r"`optim.weight_decay_exclude`: value 'none' chooses the parameters "
                                        r"optim.weight_decay spares, and optim.weight_decay is 0.*fix: set "
                                        r"optim.weight_decay"):
        JobSpec.from_dict({"data": {"path": "d"}, "optim": {"weight_decay_exclude": "none"}})
