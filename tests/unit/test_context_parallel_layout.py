"""Context parallelism outside the kernels: the spec's cp checks, the grid and data split, global positions,
and the planner's cp arithmetic and picker (issue 16)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from orchestrator.planning.estimate import layer_bytes, peak_rank, render
from orchestrator.planning.layout_picker import pick_layout
from workers.data import DataCursor, TokenDataset, prepare_data
from workers.model.gpt import apply_rotary, token_positions
from workers.parallel.context_layout import ContextShard
from workers.parallel.context_parallel import zigzag_indices

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "seq_len": 32}


def _job(model: dict | None = None, **sections) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none",
                              "model": {**TINY, **(model or {})}, **sections})


def _refusal(model: dict | None = None, **sections) -> SpecError:
    with pytest.raises(SpecError) as info:
        _job(model, **sections)
    return info.value


def test_cp_is_a_rank_axis_between_pp_and_tp():
    grid = _job(parallel={"dp": 2, "pp": 2, "cp": 2, "tp": 2}, train={"microbatches": 2}).parallel.grid
    assert grid.world_size == 16 and grid.mesh_dims == ("dp", "pp", "cp", "tp")
    assert grid.coords(2).cp == 1 and grid.coords(2).tp == 0  # tp innermost, then cp


def test_seq_len_must_split_into_2cp_chunks():
    err = _refusal({"seq_len": 36}, parallel={"cp": 4})
    assert err.field == "model.seq_len" and err.value == 36 and "2*parallel.cp = 8" in err.problem
    assert "multiple of 8" in err.fix and "pick parallel.cp from [1, 2, 3, 6, 9, 18]" in err.fix


def test_sequence_parallel_needs_each_cp_share_to_split_over_tp():
    err = _refusal({"seq_len": 12}, parallel={"cp": 2, "tp": 4})  # 4 | 12 and 2*cp | 12, but tp does not divide 6
    assert err.field == "model.seq_len" and err.value == 12 and "multiple of 8" in err.problem
    assert _job({"seq_len": 12}, parallel={"cp": 2, "tp": 4, "sequence_parallel": False}).parallel.cp == 2


def test_ulysses_needs_heads_it_can_deal_out():
    err = _refusal({"n_heads": 4}, parallel={"cp": 8, "cp_impl": "ulysses"})
    assert err.field == "parallel.cp" and err.value == 8 and "ulysses" in err.problem
    assert "pick parallel.cp from [2, 4]" in err.fix and "ring or allgather" in err.fix
    # K/V heads fewer than cp are replicated (cp % Hkv == 0): allowed
    assert _job({"arch": "llama", "n_heads": 4, "n_kv_heads": 1}, parallel={"cp": 2, "cp_impl": "ulysses"})
    err = _refusal({"arch": "llama", "d_model": 48, "n_heads": 6, "n_kv_heads": 3, "seq_len": 48},
                   parallel={"cp": 2, "cp_impl": "ulysses"})
    assert err.field == "parallel.cp" and "n_kv_heads/tp = 3" in err.problem


def test_cp_with_parameter_server_is_refused():
    err = _refusal(parallel={"cp": 2, "dp_sync": "ps"})
    assert err.field == "parallel.dp_sync" and err.value == "ps" and "allreduce" in err.fix


@pytest.mark.parametrize(("moe", "field", "value"), [
    ({"router": "switch"}, "model.moe.router", "switch"),
    ({"router": "noisy_topk"}, "model.moe.router", "noisy_topk"),
    ({"router": "topk", "expert_dropout": 0.1}, "model.moe.expert_dropout", 0.1),
])
def test_cp_with_an_moe_it_cannot_route_per_token_is_refused(moe, field, value):
    """Capacity queues, per-sequence noise and dropout keys read token positions in sequence order, which a cp
    rank's zigzag share does not have: refused rather than silently off the reference."""
    err = _refusal({"moe": {"experts": 4, **moe}}, parallel={"cp": 2})
    assert (err.field, err.value) == (field, value) and "parallel.cp: 1" in err.fix


def test_cp_with_a_topk_moe_and_ep_from_dp_and_cp_is_accepted():
    job = _job({"moe": {"experts": 4, "router": "topk", "aux_loss_weight": 0.01}}, parallel={"cp": 2, "ep": 2})
    assert (job.parallel.cp, job.parallel.ep, job.parallel.world_size) == (2, 2, 2)


def test_unknown_cp_impl_is_refused_naming_the_choices():
    with pytest.raises(SpecError) as info:
        _job(parallel={"cp": 2, "cp_impl": "flash"})
    assert "parallel.cp_impl" in str(info.value) and "ring" in str(info.value)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens")
    prepare_data([Path(sysconfig.get_paths()["stdlib"]) / "json"], out)
    return TokenDataset(out, 16, seed=0)


def test_cursor_splits_inputs_and_targets_by_zigzag_and_cp_ranks_cover_the_sequence(dataset):
    whole_x, whole_y = DataCursor(dataset, 4, 0, 1).next_batch()
    shares = [DataCursor(dataset, 4, 0, 1, cp_rank=r, cp_size=2).next_batch() for r in range(2)]
    for r, (x, y) in enumerate(shares):
        idx = zigzag_indices(16, 2, r)
        assert torch.equal(x, whole_x[:, idx]) and torch.equal(y, whole_y[:, idx])
    positions = torch.cat([zigzag_indices(16, 2, r) for r in range(2)])
    assert torch.equal(torch.cat([x for x, _ in shares], 1)[:, positions.argsort()], whole_x)


def test_rotary_at_global_positions_equals_the_whole_sequences_rows():
    x = torch.randn(2, 16, 4, 8)
    whole = apply_rotary(x, token_positions(None, 16, x.device))
    shard = ContextShard(group=None, size=2, rank=1, impl="ring")
    idx = zigzag_indices(16, 2, 1)
    local = apply_rotary(x[:, idx], token_positions(shard, 8, x.device))
    assert torch.allclose(local, whole[:, idx])


def _long(parallel: dict, impl: str = "ring", recompute: str = "none") -> JobSpec:
    return _job({"seq_len": 4096, "d_model": 256, "n_heads": 8}, parallel={**parallel, "cp_impl": impl},
                train={"global_batch_size": 2, "microbatches": 1}, memory={"recompute": recompute})


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_block_activations_per_rank_are_a_cpth(impl):
    one, four = layer_bytes(_long({})), layer_bytes(_long({"cp": 4}, impl))
    assert four == pytest.approx(one / 4, rel=0.01)


def test_allgather_keeps_the_whole_sequences_k_and_v():
    ring, gathered = layer_bytes(_long({"cp": 4})), layer_bytes(_long({"cp": 4}, "allgather"))
    kv = 2 * 4 * 2 * 4096 * 256  # k and v, fp32, batch 2, whole sequence
    assert gathered - ring == kv  # the gathered blocks, stacked, beside the local k and v both kernels keep


def test_render_names_the_cp_degree_and_kernel():
    head = render(_long({"cp": 2, "dp": 2})).splitlines()[0]
    assert "dp=2 x pp=1 x cp=2 x tp=1 = 4 ranks" in head and "cp_impl=ring" in head


def test_picker_gives_a_128k_token_llama_cp_on_80gb_gpus():
    spec = JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none",
                              "model": {"preset": "llama3-8b", "seq_len": 131072},
                              "train": {"global_batch_size": 16, "microbatches": 16},
                              "precision": {"dtype": "bf16"}, "memory": {"recompute": "full"}})
    choice = pick_layout(spec, nodes=2, gpus_per_node=8, gpu_mem=80 * 10**9)
    assert choice.spec.parallel.cp > 1
    assert peak_rank(choice.spec).total_bytes <= 0.9 * 80 * 10**9  # fits with the default 10% headroom
    same_without_cp = [c for c in choice.result.best if c.layout.cp == 1]
    assert not same_without_cp or same_without_cp[0].step_s >= choice.candidate.step_s


def test_picker_leaves_short_sequences_without_cp():
    choice = pick_layout(_job(train={"global_batch_size": 8, "microbatches": 1}), 1, 4, 10**9)
    assert choice.spec.parallel.cp == 1


def test_picker_puts_a_cp_job_on_cp1_without_its_cp_impl():
    """The job's kernel for its cp=2 layout means nothing at cp=1, where it would be refused as ignored: the
    picked spec goes back to the default instead of every cp=1 layout being listed as not runnable."""
    job = _job({"seq_len": 64}, parallel={"cp": 2, "cp_impl": "ulysses"},
               train={"global_batch_size": 8, "microbatches": 1})
    choice = pick_layout(job, 1, 4, 10**9)
    assert choice.spec.parallel.cp == 1 and choice.spec.parallel.cp_impl == "ring"
    assert not [t for t in choice.tried if "cp_impl" in t]
