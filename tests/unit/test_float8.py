"""`precision.float8`: torchao's float8 training (emulated on CPU) on the blocks' linear layers trains as bf16 does,
composes with FSDP2 (tensorwise's float8 all-gather), tp/sp and pp, resumes bit-identically, and checkpoints plain
weights that a job without float8 reads at another ZeRO stage; the head and routers keep their precision; fp16,
LoRA and GPUs without FP8 matmuls are refused.

The runs (the tiny job in bf16, 2 spawned gloo ranks, no Ray): bf16 and rowwise at ZeRO-3 for 40 steps, rowwise
saving after 20 and resumed; tensorwise at ZeRO-3 saving after 20, resumed with tensorwise and, resharded, without
float8 at ZeRO-1; and 4 steps each of tp=2 with sequence parallelism and pp=2.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from orchestrator.errors import SpecError
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import run_layouts
from workers.model import float8
from workers.model.registry import build_model, family, model_config

STEPS, SAVED_AT, SHORT = 40, 20, 4


def _tiny_llama(moe: dict | None = None) -> nn.Module:
    return build_model(model_config({"arch": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64,
                                     "seq_len": 16, "moe": moe}))


def test_the_blocks_linears_are_swapped_and_the_head_and_routers_kept():
    from torchao.float8.float8_linear import Float8Linear

    model = _tiny_llama({"experts": 4, "router": "topk"})
    blocks = family("llama").hook("blocks")(model)
    swapped = float8.apply_float8(blocks, "rowwise", torch.device("cpu"), fsdp=False)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert swapped == sum(k is Float8Linear for k in kinds.values()) > 0
    assert all(k is Float8Linear for n, k in kinds.items() if n.endswith((".wq", ".wk", ".wv", ".wo")))
    assert all(k is nn.Linear for n, k in kinds.items() if "router" in n or n == "output")
    routers = [m for n, m in model.named_modules() if n.endswith(".router")]
    assert routers and not any(isinstance(m, Float8Linear) for r in routers for m in r.modules())
    assert float8.apply_float8(blocks, "none", torch.device("cpu"), fsdp=False) == 0
    assert not float8.swaps(nn.Linear(24, 32), "layers.0.wq")  # 24 is not a multiple of 16


def test_emulated_off_cuda_and_float8_all_gather_only_for_tensorwise_under_fsdp():
    cpu = torch.device("cpu")
    assert float8.float8_config("rowwise", cpu, fsdp=True).emulate
    assert float8.float8_config("tensorwise", cpu, fsdp=True).enable_fsdp_float8_all_gather
    assert not float8.float8_config("rowwise", cpu, fsdp=True).enable_fsdp_float8_all_gather
    assert not float8.float8_config("tensorwise", cpu, fsdp=False).enable_fsdp_float8_all_gather


def test_a_gpu_without_fp8_matmuls_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"precision.float8 'rowwise'.*A100.*8\.0.*8\.9.*precision.float8: none"):
        float8.check_float8_device("rowwise", torch.device("cuda", 0))
    float8.check_float8_device("none", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    float8.check_float8_device("tensorwise", torch.device("cuda", 0))  # Hopper


@pytest.mark.parametrize("sections, why", [
    ({"precision": {"dtype": "fp16"}}, "fp16"),
    ({"model": {"lora": {"rank": 4}}}, "model.lora"),
])
def test_float8_is_refused_where_it_does_not_compose(sections, why, token_data, tmp_path):
    sections = {k: dict(v) for k, v in sections.items()}
    sections["precision"] = {**sections.get("precision", {}), "float8": "rowwise"}
    with pytest.raises(SpecError, match=rf"precision.float8.*{why}.*"):
        tiny_spec(token_data, tmp_path, **sections)


def _spec(token_data, tmp, name: str, recipe: str, steps: int = STEPS, **parallel) -> dict:
    return tiny_spec(token_data, tmp / name, precision={"dtype": "bf16", "float8": recipe},
                     parallel={"dp": 2, "zero": 3, **parallel}, train={"steps": steps}).worker_dict()


@pytest.fixture(scope="module")
def runs(token_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("float8")
    rowwise, tensorwise = str(tmp / "rowwise-saved"), str(tmp / "tensorwise-saved")
    jobs = {  # name: (spec, steps, checkpoint, resume, save_after)
        "bf16": (_spec(token_data, tmp, "bf16", "none"), STEPS, None, None, None),
        "rowwise": (_spec(token_data, tmp, "rowwise", "rowwise"), STEPS, rowwise, None, SAVED_AT),
        "rowwise-resumed": (_spec(token_data, tmp, "rr", "rowwise"), STEPS - SAVED_AT, None, rowwise, None),
        "tensorwise": (_spec(token_data, tmp, "tensorwise", "tensorwise"), SAVED_AT + 1, tensorwise, None,
                       SAVED_AT),
        "tensorwise-resumed": (_spec(token_data, tmp, "tr", "tensorwise"), 1, None, tensorwise, None),
        "plain-zero1": (_spec(token_data, tmp, "plain", "none", zero=1), 1, None, tensorwise, None),
        "tp-sp": (_spec(token_data, tmp, "tp", "tensorwise", dp=1, zero=0, tp=2, sequence_parallel=True),
                  SHORT, None, None, None),
        "bf16-tp-sp": (_spec(token_data, tmp, "btp", "none", dp=1, zero=0, tp=2, sequence_parallel=True),
                       SHORT, None, None, None),
        "pp": (_spec(token_data, tmp, "pp", "rowwise", dp=1, zero=0, pp=2), SHORT, None, None, None),
    }
    specs, steps, saves, resumes, afters = zip(*jobs.values())
    out = run_layouts(list(specs), 2, list(steps), checkpoints=list(saves), resumes=list(resumes),
                      save_afters=list(afters))
    return {**dict(zip(jobs, out)), "checkpoint": tensorwise}


def test_forty_emulated_rowwise_steps_end_within_two_percent_of_bf16(runs):
    bf16, rowwise = runs["bf16"].losses, runs["rowwise"].losses
    assert bf16[-1] < 0.8 * bf16[0]  # it trained
    assert rowwise[-1] == pytest.approx(bf16[-1], rel=0.02)
    assert rowwise != bf16  # float8's rounding shows: the layers were swapped


def test_float8_resumes_bit_identically(runs):
    assert runs["rowwise-resumed"].losses == runs["rowwise"].losses[SAVED_AT:]
    assert runs["tensorwise-resumed"].losses == runs["tensorwise"].losses[SAVED_AT:]


def test_float8_checkpoints_hold_plain_weights_that_a_bf16_job_reshards(runs):
    metadata = FileSystemReader(runs["checkpoint"]).read_metadata().state_dict_metadata
    weights = {k: v for k, v in metadata.items() if k.startswith("model.")}
    assert weights and all(isinstance(v, TensorStorageMetadata) for v in weights.values())
    assert {v.properties.dtype for v in weights.values()} == {torch.float32}
    # the same weights at step 21 without float8 (ZeRO-1's slices): only float8's rounding differs
    assert runs["plain-zero1"].losses == pytest.approx(runs["tensorwise"].losses[SAVED_AT:], rel=0.02)


def test_float8_composes_with_tensor_sequence_and_pipeline_parallelism(runs):
    assert runs["tp-sp"].losses == pytest.approx(runs["bf16-tp-sp"].losses, rel=0.02)
    assert runs["tp-sp"].losses != runs["bf16-tp-sp"].losses
    assert runs["pp"].losses == pytest.approx(runs["bf16"].losses[:SHORT], rel=0.02)
