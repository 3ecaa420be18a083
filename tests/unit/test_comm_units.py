"""ZeRO-0 buckets, gradient compression, 1-bit Adam and the byte counter: the parts that need no process group.

The collectives themselves (parity, bytes on the wire, loss under compression) run over real gloo ranks in
tests/integration/test_comm.py.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator import JobSpec
from orchestrator.errors import SpecError
from orchestrator.observability.run_records import step_record
from workers.diagnostics.comm_bytes import ring_bytes
from workers.loop.summary import StepSummary
from workers.model.gpt import GPT
from workers.model.registry import model_config
from workers.optim.onebit_adam import pack_signs, unpack_signs
from workers.parallel.grad_buckets import plan_buckets
from workers.protocol import StepResult, StepTimes


def _spec(tmp_path, **sections):
    return JobSpec.from_dict({"data": {"path": str(tmp_path)}, **sections})


@pytest.mark.parametrize("sections, field, fix", [
    ({"parallel": {"dp": 2, "zero": 2, "bucket_mb": 4}}, "parallel.bucket_mb", "use zero: 0"),
    # beyond ZeRO-0: a 16-bit cast belongs in the reduce-scatter; PowerSGD/top-k at ZeRO-1 only, and alone there
    ({"parallel": {"dp": 2, "zero": 3, "grad_compression": "bf16"}}, "parallel.grad_compression",
     "grad_reduce_dtype: bf16"),
    ({"parallel": {"dp": 2, "zero": 1, "grad_compression": "fp16"}}, "parallel.grad_compression",
     "grad_reduce_dtype: bf16"),
    ({"parallel": {"dp": 2, "zero": 2, "grad_compression": "powersgd"}}, "parallel.grad_compression",
     "parallel.zero: 1"),
    ({"parallel": {"dp": 2, "zero": 3, "grad_compression": "topk"}}, "parallel.grad_compression", "parallel.zero: 1"),
    ({"parallel": {"dp": 2, "zero": 1, "grad_compression": "topk", "grad_reduce_dtype": "bf16"}},
     "parallel.grad_reduce_dtype", "remove one of the two"),
    ({"parallel": {"dp": 2, "zero": 1, "ep": 2, "grad_compression": "topk"}, "model": {"moe": {"experts": 2}}},
     "parallel.ep", "parallel.ep: 1"),
    ({"parallel": {"dp": 2, "dp_sync": "ps", "grad_compression": "topk"}}, "parallel.grad_compression",
     "parameter_server.compression"),
    ({"parallel": {"grad_compression": "powersgd"}}, "parallel.grad_compression", "parallel.dp above 1"),
    ({"parallel": {"dp": 2, "powersgd_rank": 2}}, "parallel.powersgd_rank", "grad_compression: powersgd"),
    ({"parallel": {"dp": 2, "grad_compression": "topk", "powersgd_warmup_steps": 5}},
     "parallel.powersgd_warmup_steps", "grad_compression: powersgd"),
    # the default 10-step warm-up would cover a 10-step run: nothing compressed is refused, not run
    ({"parallel": {"dp": 2, "grad_compression": "powersgd"}, "train": {"steps": 10}},
     "parallel.powersgd_warmup_steps", "below 10"),
    ({"parallel": {"dp": 2, "grad_compression": "bf16", "topk_ratio": 0.1}}, "parallel.topk_ratio",
     "grad_compression: topk"),
    ({"optim": {"name": "onebit_adam", "warmup_steps": 5}, "parallel": {"dp": 2, "zero": 2}}, "parallel.zero",
     "parallel.zero: 0"),
    ({"optim": {"name": "onebit_adam", "warmup_steps": 5}, "parallel": {"dp": 2, "grad_compression": "fp16"}},
     "parallel.grad_compression", "grad_compression: none"),
    ({"optim": {"name": "onebit_adam"}, "parallel": {"dp": 2}}, "optim.warmup_steps", "set optim.warmup_steps"),
    ({"parallel": {"dp": 2, "topk_ratio": 0}}, "parallel.topk_ratio", None),
])
def test_refused_with_field_and_fix(tmp_path, sections, field, fix):
    with pytest.raises(SpecError) as info:
        _spec(tmp_path, **sections)
    assert info.value.field == field and (fix is None or fix in str(info.value))


@pytest.mark.parametrize("kind", ["powersgd", "topk"])
def test_error_feedback_kinds_are_accepted_at_zero_1_with_hybrid_sharding(tmp_path, kind):
    spec = _spec(tmp_path, parallel={"dp": 4, "dp_shard": 2, "zero": 1, "grad_compression": kind})
    assert spec.worker_dict()["parallel"]["grad_compression"] == kind


def test_settings_reach_the_workers_and_survive_a_round_trip(tmp_path):
    spec = _spec(tmp_path, parallel={"dp": 2, "grad_compression": "topk", "topk_ratio": 0.05, "bucket_mb": 0},
                 metrics={"comm_bytes": True})
    again = JobSpec.from_dict(spec.to_dict())  # every field written out: defaults are not mistaken for settings
    par = again.worker_dict()["parallel"]
    assert (par["grad_compression"], par["topk_ratio"], par["bucket_mb"]) == ("topk", 0.05, 0)
    assert again.worker_dict()["metrics"]["comm_bytes"] is True


def test_sign_packing_round_trips_at_any_length():
    for n in (1, 7, 8, 9, 100):
        x = torch.randn(n)
        x[0] = 0.0  # zero counts as positive: its sign must not be lost
        packed = pack_signs(x)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8)  # 1 bit per entry
        assert torch.equal(unpack_signs(packed, n), torch.where(x >= 0, 1.0, -1.0))


def test_onebit_adam_compresses_parameters_whose_sign_bytes_leave_the_scales_unaligned():
    """3 + 5 entries pack into 1 + 1 sign bytes, so the scales after them start at byte 2; the compressed step
    leaves each momentum at ± its own scale (one rank: the average is its own)."""
    from workers.optim.onebit_adam import OneBitAdam

    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(5))]
    opt = OneBitAdam(params, None, warmup_steps=1, lr=1e-2)
    for _ in range(3):  # one warm-up step, then two compressed ones
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in params:
        magnitude = opt.state[p]["exp_avg"].abs()
        assert torch.allclose(magnitude, magnitude[0].expand_as(magnitude)) and magnitude[0] > 0


@pytest.mark.parametrize("kind, payload, n, sent", [
    ("all_reduce", 1000, 2, 1000),  # ring all-reduce: 2(N-1)/N of the tensor
    ("all_reduce", 1000, 4, 1500),
    ("all_gather", 100, 4, 300),  # (N-1) chunks of this rank's input
    ("reduce_scatter", 1000, 4, 750),
    ("send", 64, 2, 64),
    ("all_reduce", 1000, 1, 0),  # a one-rank group moves nothing
])
def test_ring_bytes(kind, payload, n, sent):
    assert ring_bytes(kind, payload, n) == sent


def _tiny_gpt():
    cfg = model_config({"d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64, "seq_len": 32, "vocab_size": 256})
    with torch.device("meta"):
        return GPT(cfg)


def test_buckets_follow_blocks_in_backward_order():
    model = _tiny_gpt()
    blocks = list(model.layers.values())
    per_unit = plan_buckets(model, blocks, cap_bytes=0)  # every block (and every other parameter) its own bucket
    in_blocks = {id(p) for blk in blocks for p in blk.parameters()}
    block_buckets = [b for b in per_unit if id(b[0]) in in_blocks]
    assert [{id(p) for p in b} for b in block_buckets] == [{id(p) for p in blk.parameters()}
                                                         for blk in reversed(blocks)]
    assert sum(len(b) for b in per_unit) == len(list(model.parameters()))
    whole = plan_buckets(model, blocks, cap_bytes=float("inf"))  # bucket_mb 0: one bucket
    assert len(whole) == 1 and len(whole[0]) == len(list(model.parameters()))
    block_bytes = sum(p.numel() * 4 for p in blocks[0].parameters())
    two_blocks = plan_buckets(model, blocks, cap_bytes=2 * block_bytes)  # a bucket closes once it holds the cap
    assert len(two_blocks) < len(per_unit)


def _result(rank: int, comm: dict | None) -> StepResult:
    return StepResult(rank=rank, step=1, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=8, applied=True,
                      time_s=StepTimes(), peak_memory_bytes=0, current_memory_bytes=0, comm_bytes=comm)


def test_step_record_keeps_the_busiest_ranks_bytes_per_dim():
    ranks = [_result(0, {"dp": 10, "pp": 5, "tp": 0}), _result(1, {"dp": 12, "pp": 3, "tp": 0})]
    record = step_record(StepSummary.of_all(ranks), 1.0, 8, 0.0, 0.0)
    assert record["comm_bytes"] == {"dp": 12, "pp": 5, "tp": 0}
    uncounted = StepSummary.of_all([_result(0, None)])
    assert "comm_bytes" not in step_record(uncounted, 1.0, 8, 0.0, 0.0)  # not counted: not claimed
    assert StepResult.from_dict(_result(0, {"dp": 1}).to_dict()).comm_bytes == {"dp": 1}
