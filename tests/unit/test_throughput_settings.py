"""train.compile, optim.implementation and parallel.fsdp_prefetch: blocks compiled in place (names kept), the three
optimizer kernels agreeing, prefetch lists set on FSDP2's units, and what none can combine with refused in the
spec with the field and the fix.

Compiling is lazy: these tests build and wrap, but never run a compiled block (that costs seconds on CPU and
is checked against the reference in tests/integration/test_throughput_parity.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from workers.contract.sections import OptimSection
from workers.model.meta_init import build_full
from workers.model.moe import MoELayer
from workers.model.registry import family, model_config
from workers.optim.build import build_optimizer
from workers.parallel.compile import compile_blocks, is_compiled
from workers.parallel.fsdp_prefetch import set_prefetch
from workers.parallel.recompute import apply_recompute

TINY_LLAMA = {"arch": "llama", "d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
              "seq_len": 16, "vocab_size": 64}


def _spec(tmp_path, **sections) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": str(tmp_path)}, **sections})


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_blocks_are_compiled_in_place_and_names_do_not_change(recompute):
    model = build_full(model_config(TINY_LLAMA), seed=0)
    names = [n for n, _ in model.named_parameters()]
    fam = family("llama")
    apply_recompute(model, recompute, fam, compiled=True)
    blocks = compile_blocks(model, fam)
    assert [n for n, _ in model.named_parameters()] == names  # no _orig_mod. prefix
    assert blocks == list(model.layers.values()) and all(is_compiled(b) for b in blocks)
    assert not is_compiled(model) and not is_compiled(model.tok_embeddings)  # the ends stay eager
    target = {"none": None, "full": blocks[0], "selective": blocks[0].attention.core}[recompute]
    if target is not None:  # recomputed from inside forward, bound to the module (a deepcopy binds to the copy)
        assert target.forward.__self__ is target
        twin = copy.deepcopy(target)
        assert twin.forward.__self__ is twin


def test_an_moe_block_compiles_its_dense_parts_and_leaves_the_moe_layer_eager():
    """Routing is data-dependent (host-read counts, variable all-to-all splits), so under train.compile a block
    holding an MoE layer (here every other one) compiles its attention and norms, each in place, and the MoE
    layer runs eagerly; a dense block still compiles whole."""
    model = build_full(model_config({**TINY_LLAMA, "moe": {"experts": 4, "every": 2}}), seed=0)
    names = [n for n, _ in model.named_parameters()]
    blocks = compile_blocks(model, family("llama"))
    assert [n for n, _ in model.named_parameters()] == names
    moe_blocks = [b for b in blocks if isinstance(b.feed_forward, MoELayer)]
    assert moe_blocks and len(moe_blocks) < len(blocks)
    for block in blocks:
        moe = block in moe_blocks
        assert is_compiled(block) is not moe
        parts = (block.attention, block.attention_norm, block.ffn_norm)
        assert all(is_compiled(p) is moe for p in parts)
        assert not any(is_compiled(m) for m in block.feed_forward.modules()) if moe else True


def _trained(name: str, implementation: str, steps: int = 3) -> list[torch.Tensor]:
    model = build_full(model_config(TINY_LLAMA), seed=0)
    optim = OptimSection(name=name, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), momentum=0.9,
                         implementation=implementation)
    opt = build_optimizer(model.parameters(), optim)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_fused_foreach_and_for_loop_step_alike(name):
    loop = _trained(name, "for_loop")
    for implementation in ("fused", "foreach"):
        for a, b in zip(_trained(name, implementation), loop, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_implementation_reaches_pytorchs_optimizer():
    params = [torch.nn.Parameter(torch.ones(2))]
    base = OptimSection(name="adamw", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    assert build_optimizer(params, base.model_copy(update={"implementation": "fused"})).defaults["fused"] is True
    assert build_optimizer(params, base.model_copy(update={"implementation": "foreach"})).defaults["foreach"] is True
    loop = build_optimizer(params, base.model_copy(update={"implementation": "for_loop"})).defaults
    assert loop["foreach"] is False and not loop["fused"]
    assert not build_optimizer(params, base).defaults["fused"]  # CPU: PyTorch's default


@pytest.mark.parametrize("sections, field, fix", [
    ({"train": {"compile": True, "microbatches": 4}, "parallel": {"pp": 2, "pp_schedule": "zbv"}},
     "parallel.pp_schedule", "interleaved_1f1b"),
    ({"train": {"compile": True}, "parallel": {"tp": 2}, "memory": {"recompute": "full"}}, "memory.recompute",
     "memory.recompute: none"),
    ({"train": {"compile": True}, "memory": {"measure": True, "recompute": "selective"}}, "memory.measure",
     "memory.measure: false"),
    ({"optim": {"name": "sm3", "implementation": "fused"}}, "optim.implementation", "remove optim.implementation"),
    ({"optim": {"name": "adafactor", "implementation": "fused"}}, "optim.implementation", "foreach, for_loop"),
    ({"optim": {"implementation": "foreach"}, "memory": {"offload": {"optimizer": True}}}, "optim.implementation",
     "without memory.offload.optimizer"),
    ({"optim": {"implementation": "fused"}, "parallel": {"dp": 2, "dp_sync": "ps"}}, "optim.implementation",
     "remove optim.implementation"),
    ({"optim": {"implementation": "fused"}, "parallel": {"tp": 2, "sequence_parallel": False}},
     "optim.implementation", "parallel.sequence_parallel: true"),
    ({"parallel": {"dp": 2, "zero": 1, "fsdp_prefetch": 2}}, "parallel.fsdp_prefetch", "parallel.zero: 2 or 3"),
])
def test_refused_with_field_and_fix(tmp_path, sections, field, fix):
    with pytest.raises(SpecError) as info:
        _spec(tmp_path, **sections)
    assert info.value.field == field and fix in str(info.value)


def test_accepted_combinations_reach_the_workers(tmp_path):
    spec = _spec(tmp_path, train={"compile": True}, parallel={"dp": 2, "zero": 3, "tp": 2, "fsdp_prefetch": 2},
                 memory={"measure": True}, optim={"implementation": "fused"})
    raw = spec.worker_dict()
    assert raw["train"]["compile"] is True and raw["optim"]["implementation"] == "fused"
    assert raw["parallel"]["fsdp_prefetch"] == 2


@pytest.mark.parametrize("impl", ["ring", "allgather", "ulysses"])
def test_compile_takes_context_parallelism_and_document_masks(tmp_path, impl):
    """Attention is a custom operator (``workers.model.attention_ops``) compiled blocks trace around: cp and
    document masks no longer refuse train.compile (tests/integration/test_compile_attention.py runs them)."""
    spec = _spec(tmp_path, train={"compile": True}, parallel={"cp": 2, "cp_impl": impl},
                 model={"attention_mask": "document", "seq_len": 8, "n_heads": 2})
    assert spec.train.compile and spec.parallel.cp == 2 and spec.model.attention_mask == "document"


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo group in this process (FSDP2 needs a mesh to shard over), torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_prefetch_lists_reach_fsdp2(one_rank_mesh):
    model = build_full(model_config(TINY_LLAMA), seed=0)
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=one_rank_mesh)
    set_prefetch(blocks, 2)

    def states(block, direction):
        return getattr(block._get_fsdp_state(), f"_states_to_{direction}_prefetch")

    def of(*indices):
        return [blocks[i]._get_fsdp_state() for i in indices]

    assert [states(b, "forward") for b in blocks] == [of(1, 2), of(2, 3), of(3), of()]
    assert [states(b, "backward") for b in blocks] == [of(), of(0), of(1, 0), of(2, 1)]  # nearest first


def test_planner_holds_the_prefetched_blocks_gathered(tmp_path):
    """ZeRO-3 keeps the root unit, the block computing and the ones prefetched gathered: prefetching 3 blocks
    holds 2 more blocks' parameters than FSDP2's own one."""
    from orchestrator.planning.estimate import block_params, estimate_rank

    def gathered(prefetch: int) -> tuple[int, int]:
        spec = _spec(tmp_path, parallel={"dp": 2, "zero": 3, "fsdp_prefetch": prefetch, "device": "cpu"})
        return estimate_rank(spec, 0).state.gathered, block_params(spec)

    (own, block), (three, _) = gathered(0), gathered(3)
    assert gathered(1)[0] == own and three - own == 2 * block * 4  # fp32 gathers


class _Axis:  # a one-rank mesh axis: what build_parts asks of the pp and dp axes
    def get_local_rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


@pytest.mark.parametrize("compiled", [False, True])
def test_the_loss_is_compiled_with_the_blocks(tmp_path, compiled):
    """Under train.compile the builder marks the head's part and ``model_loss`` runs ``lm_loss`` through
    ``torch.compile`` (made once per process), with the eager loss and gradient; without it, eagerly."""
    from tests.support.jobs import tiny_spec
    from workers.model import gpt
    from workers.parallel.parallelize import build_parts
    from workers.spec import WorkerSpec

    job = tiny_spec(tmp_path, tmp_path, model={"arch": "llama", "n_kv_heads": 2}, train={"compile": compiled})
    (stage,) = build_parts(WorkerSpec.from_dict(job.worker_dict()), {"pp": _Axis(), "dp": _Axis()},
                           torch.device("cpu")).modules
    assert stage.compile_loss is compiled
    gpt.compiled_lm_loss.cache_clear()
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0), requires_grad=True)
    targets = torch.tensor([[1, 2, -100, 4, 5], [6, 7, 8, 9, 10]])
    for reduction in ("mean", "sum"):
        loss = gpt.model_loss(stage, logits, targets, reduction)
        (grad,) = torch.autograd.grad(loss, logits)
        eager = gpt.lm_loss(logits, targets, reduction)
        assert torch.allclose(loss, eager, rtol=1e-6) and torch.allclose(grad, torch.autograd.grad(eager, logits)[0])
    assert gpt.compiled_lm_loss.cache_info().currsize == int(compiled)
