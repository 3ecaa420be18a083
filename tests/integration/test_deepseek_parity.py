"""DeepSeek-V3 (``model.arch: deepseek_v3``) trains as the single-process reference does where its experts and its
layers are cut, without Ray (tests/support/parity_harness.py; fp32, CPU, 4 steps, 1e-4): expert parallelism over
the sigmoid, group-limited router with the balancing bias (each rank moves the bias by the load summed over dp),
ZeRO-3 over the expert stacks, pipeline stages cut between the dense first layer and the MoE ones, and tensor
parallelism (``workers.parallel.deepseek_parallel``: MLA split by heads, the shared experts by hidden units) with
the routed experts split over tp too (``parallel.expert_tp``) at dp2 x tp2 x ep2. Then a tiny random
``DeepseekV3ForCausalLM`` through ``model.init_from``: the first step's loss is transformers' to 1e-5 at one
process, dp2 x ep2, pp2, tp2 and dp2 x tp2 x ep2 with expert_tp, and the steps follow the reference; ``export-hf``
of the dp2 x tp2 x ep2 run's checkpoint writes exactly the tensors DCP holds, and transformers reads them back.
The model itself is checked against transformers in tests/unit/test_deepseek.py.

Multi-token prediction (``model.mtp_layers: 2``, its MoE blocks' experts split too): dp2 x ep2 and dp2 ZeRO-3 follow
the single-process reference that trains with the loop of tests/support/mtp_reference.py, and report the one
process's MTP figures (tests/unit/test_mtp.py checks the model against that loop)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.spec.lora import export_hf_weights
from tests.support.hf import dcp_model_tensors, save_hf_deepseek, transformers_first_step
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import assert_follows_reference
from workers.model import deepseek

STEPS = 4
MODEL = {"arch": "deepseek_v3", "d_model": 32, "n_heads": 4, "d_ff": 48, "q_lora_rank": 16, "kv_lora_rank": 12,
         "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "dense_layers": 1,
         "moe": {"experts": 8, "top_k": 2, "router": "sigmoid", "groups": 4, "top_groups": 2, "gate_scale": 2.5,
                 "shared_experts": 1, "d_expert": 16, "bias_balancing": True, "bias_update_rate": 0.01,
                 "aux_loss_weight": 0.001}}
ETP = {"dp": 2, "tp": 2, "ep": 2, "expert_tp": True}  # 4 ranks: ep borrows from dp, the experts split over tp
LAYOUTS = {"dp2-ep2": ({"dp": 2, "ep": 2}, {}), "dp2-zero3": ({"dp": 2, "zero": 3}, {}),
           "pp2": ({"pp": 2}, {"microbatches": 2}), "dp2-ep2-pp2": ({"dp": 2, "ep": 2, "pp": 2}, {"microbatches": 2}),
           "dp2-tp2-ep2-etp": (ETP, {})}


# the tiny job's shape (4 layers, d_model 32, 4 heads, d_ff 64), MLA and 8 experts in 4 groups as MODEL's
HF = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
      "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
      "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
      "max_position_embeddings": 64, "routed_scaling_factor": 2.5}
MTP = {**MODEL, "mtp_layers": 2, "mtp_loss_weight": 0.3}
MTP_LAYOUTS = {"mtp-one": ({}, {}), "mtp-dp2-ep2": ({"dp": 2, "ep": 2}, {}),
               "mtp-dp2-zero3": ({"dp": 2, "zero": 3}, {})}
HF_LAYOUTS = {"hf-one": ({}, {}), "hf-dp2-ep2": ({"dp": 2, "ep": 2}, {}), "hf-pp2": ({"pp": 2}, {"microbatches": 2}),
              "hf-tp2": ({"tp": 2}, {}), "hf-dp2-tp2-ep2-etp": (ETP, {})}
EXPORTED = "hf-dp2-tp2-ep2-etp"  # the layout whose checkpoint export-hf writes


@pytest.fixture(scope="module")
def cases(token_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-parity")
    out = {name: tiny_spec(token_data, root / name, parallel={**parallel, "device": "cpu"}, model=MODEL,
                           train={"steps": STEPS, **train})
           for name, (parallel, train) in LAYOUTS.items()}
    out.update({name: tiny_spec(token_data, root / name, parallel={**parallel, "device": "cpu"}, model=MTP,
                                train={"steps": STEPS, **train}) for name, (parallel, train) in MTP_LAYOUTS.items()})
    _, src = save_hf_deepseek(root / "hf", HF)
    # d_ff as the tiny job has it, which the init_from job keeps
    mtp_src = _mtp_checkpoint(tiny_spec(token_data, root / "mtp-src", model={**MTP, "d_ff": 64}), root / "mtp-hf")
    out["mtp-hf-dp2-ep2"] = tiny_spec(token_data, root / "mtp-hf-dp2-ep2", parallel={"dp": 2, "ep": 2, "device": "cpu"},
                                      model={"init_from": str(mtp_src), "moe": {"bias_balancing": True}},
                                      train={"steps": STEPS})
    for name, (parallel, train) in HF_LAYOUTS.items():  # the job's moe: its training settings (bias balancing)
        out[name] = tiny_spec(token_data, root / name, parallel={**parallel, "device": "cpu"},
                              model={"init_from": str(src), "moe": {"bias_balancing": True, "aux_loss_weight": 0.0}},
                              train={"steps": STEPS, **train})
    return out


def _mtp_checkpoint(spec, directory):
    """A DeepSeek-layout checkpoint with two MTP layers (``raymesh export-hf``'s writer, random weights)."""
    import torch

    from workers.model.hf_io import write_hf
    from workers.model.registry import build_model, model_config

    torch.manual_seed(1)
    model = build_model(model_config(spec.worker_dict()["model"]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return write_hf(model.state_dict(), model.cfg, directory)


@pytest.fixture(scope="module")
def runs(cases):
    return run_grouped(cases, checkpoints={EXPORTED: _written(cases)})


def _written(cases) -> str:
    """Where the ``EXPORTED`` layout's ranks save their final state."""
    return str(Path(cases[EXPORTED].run_dir) / "final")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_the_reference(name, cases, runs):
    assert_follows_reference(ran(runs, name), cases[name], STEPS)


@pytest.mark.parametrize("name", list(HF_LAYOUTS))
def test_init_from_starts_at_transformers_loss_and_follows_the_reference(name, cases, runs):
    run, spec = ran(runs, name), cases[name]
    assert spec.model.arch == "deepseek_v3" and spec.model.moe.router == "sigmoid"
    loss, _ = transformers_first_step(spec, spec.model.init_from)
    assert run.losses[0] == pytest.approx(loss, abs=1e-5)
    assert_follows_reference(run, spec, STEPS)


@pytest.mark.parametrize("name", list(MTP_LAYOUTS))
def test_mtp_layout_matches_the_reference_and_reports_the_one_process_figures(name, cases, runs):
    run, one = ran(runs, name), ran(runs, "mtp-one")
    assert_follows_reference(run, cases[name], STEPS)
    figures = [[step["mtp"] for step in steps] for steps in run.results.values()]
    assert all(f == figures[0] for f in figures)  # every rank reports the dp-reduced figures
    for ours, alone in zip(figures[0], [step["mtp"] for step in one.results[0]]):
        assert len(ours["depths"]) == 2 and ours["loss"] == pytest.approx(alone["loss"], rel=1e-4)
        assert ours["depths"] == pytest.approx(alone["depths"], rel=1e-4)


def test_init_from_a_checkpoint_with_its_mtp_layers_follows_the_reference(cases, runs):
    """The MTP layers' experts read by expert slice (dp2 x ep2), the rest whole: the reference reads them whole."""
    spec = cases["mtp-hf-dp2-ep2"]
    assert spec.model.mtp_layers == 2
    assert_follows_reference(ran(runs, "mtp-hf-dp2-ep2"), spec, STEPS)


def test_export_hf_of_the_tensor_parallel_run_writes_the_checkpoint_exactly(cases, runs, tmp_path):
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    ran(runs, EXPORTED)
    written = _written(cases)
    out = export_hf_weights(cases[EXPORTED], written, str(tmp_path / "exported"))
    held = deepseek.to_hf_state(dcp_model_tensors(written, tmp_path / "c.pt"))
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(held)
    for key, value in exported.items():
        assert torch.equal(value, held[key]), key
    # transformers keeps the routed experts fused in memory; saved again, they are the exported tensors exactly
    DeepseekV3ForCausalLM.from_pretrained(out).save_pretrained(tmp_path / "again")
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(again) == set(held)
    for key, value in held.items():
        assert torch.equal(again[key], value), key
