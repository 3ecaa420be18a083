"""Multi-token prediction (``model.mtp_layers``, ``workers/model/mtp.py``) for ``model.arch: deepseek_v3``.

``transformers`` builds no MTP module, so the model is checked against a reference written apart from it
(``tests/support/mtp_reference.py``) from the DeepSeek-V3 report's section 2.2 with torch functional ops and the
main model's pieces: depth k normalises h^{k-1} (depth 0:
the last block's output, before the final norm) and the embedding of the token k ahead, projects their
concatenation, runs one block and predicts the token k+1 ahead through the shared head; L = L_main + lambda/D sum
CE_k. The step's reported loss stays the next-token loss; the DeepSeek checkpoint names of the MTP layer
round-trip exactly; ``init_from`` takes the depths the safetensors hold; the planner counts them."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.support.mtp_reference import mtp_losses
from workers.model import hf_io
from workers.model.gpt import model_loss
from workers.model.mtp import begin_step, end_step
from workers.model.registry import build_model, model_config

MODEL = {"arch": "deepseek_v3", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 48,
         "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
         "dense_layers": 1, "seq_len": 32, "mtp_layers": 2, "mtp_loss_weight": 0.3,
         "moe": {"experts": 8, "top_k": 2, "router": "sigmoid", "groups": 4, "top_groups": 2, "shared_experts": 1,
                 "d_expert": 16, "aux_loss_weight": 0.0}}
WINDOW = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
TOKENS, TARGETS = WINDOW[:, :-1], WINDOW[:, 1:]


def _model(**fields):
    torch.manual_seed(0)
    return build_model(model_config({**MODEL, **fields}))


def reference_loss(model, tokens, targets, reduction: str = "mean") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The report's objective from the independent loop: (L_main + lambda/D sum_k CE_k, [CE_k])."""
    main, depths = mtp_losses(model, tokens, targets, reduction)
    return main + model.cfg.mtp_loss_weight / len(depths) * sum(depths), depths


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


@pytest.mark.parametrize(("chunks", "masked"), [(1, False), (3, False), (1, True)])
def test_gradients_are_the_reports_objective_and_the_loss_the_next_token_loss(chunks, masked):
    model = _model()
    targets = TARGETS.clone()
    if masked:  # a loss mask's prompt tokens (-100): the sum the masked objective scales
        targets[:, :7] = -100
    reduction = "sum" if masked else "mean"
    expected, depths = reference_loss(model, TOKENS, targets, reduction)
    expected.backward()
    theirs = _grads(model)
    begin_step([model])
    model.loss_chunks = chunks
    loss = model_loss(model, model(TOKENS), targets, reduction)
    model.loss_chunks = 1
    loss.backward()
    ours = _grads(model)
    with torch.no_grad():
        main = F.cross_entropy(model(TOKENS).flatten(0, 1), targets.flatten(), reduction=reduction)
    assert loss.item() == pytest.approx(main.item(), rel=1e-6)  # the reported loss: next-token only
    assert sorted(ours) == sorted(theirs) and any(n.startswith("mtp.3.") for n in ours)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    figures = end_step([model], None, torch.device("cpu"))
    counted = [(targets[:, k:] != -100).sum() for k in (1, 2)]
    means = [d.item() / (float(c) if masked else 1.0) for d, c in zip(depths, counted)]
    assert figures["depths"] == pytest.approx(means, rel=1e-6)
    assert figures["loss"] == pytest.approx(0.3 / 2 * sum(means), rel=1e-6)


def test_the_modules_change_training_but_not_inference():
    with_mtp, without = _model(), _model(mtp_layers=0)
    without.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    with torch.no_grad():
        torch.testing.assert_close(with_mtp(TOKENS), without(TOKENS), rtol=0, atol=0)
    assert with_mtp.mtp.kept is None  # nothing kept without gradients: model_loss adds nothing there
    model_loss(with_mtp, with_mtp(TOKENS), TARGETS).backward()
    model_loss(without, without(TOKENS), TARGETS).backward()
    assert not torch.allclose(with_mtp.tok_embeddings.weight.grad, without.tok_embeddings.weight.grad)


def _exported(tmp_path, model):
    out = tmp_path / "export"
    hf_io.write_hf(model.state_dict(), model.cfg, out)
    return out


def test_the_checkpoint_layer_round_trips_under_deepseeks_names(tmp_path):
    ours = _model()
    for p in ours.parameters():  # norms away from one, so a norm read into the wrong place shows
        torch.nn.init.normal_(p, 0.0, 0.1) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    out = _exported(tmp_path, ours)
    tensors = load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    for layer in (2, 3):
        for key in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "input_layernorm", "self_attn.kv_b_proj",
                    "mlp.gate", "mlp.experts.7.down_proj", "mlp.shared_experts.up_proj"):
            assert f"model.layers.{layer}.{key}.weight" in tensors
        assert torch.equal(tensors[f"model.layers.{layer}.embed_tokens.weight"], ours.tok_embeddings.weight)
        assert torch.equal(tensors[f"model.layers.{layer}.shared_head.head.weight"], ours.output.weight)
    assert torch.equal(tensors["model.layers.2.eh_proj.weight"], ours.mtp["2"].eh_proj.weight)
    again = _model()
    hf_io.load_hf_weights(again, out)
    state = again.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())
    second = load_file(_exported(tmp_path / "2", again) / "model.safetensors")
    assert sorted(second) == sorted(tensors) and all(torch.equal(second[k], tensors[k]) for k in tensors)


def test_transformers_reads_the_export_without_the_mtp_layer(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    ours = _model().eval()
    hf = DeepseekV3ForCausalLM.from_pretrained(_exported(tmp_path, ours)).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours(TOKENS), rtol=1e-5, atol=1e-5)


def _job(model: dict, parallel: dict | None = None, train: dict | None = None):
    from orchestrator import JobSpec

    return JobSpec.from_dict({"data": {"path": "/tmp/none"}, "run_dir": "/tmp/none", "parallel": parallel or {},
                              "model": model, "train": train or {}})


def test_init_from_trains_the_depths_the_safetensors_hold(tmp_path):
    from orchestrator.errors import SpecError

    out = _exported(tmp_path, _model())
    assert _job({"init_from": str(out)}).model.mtp_layers == 2
    assert _job({"init_from": str(out), "mtp_layers": 1}).model.mtp_layers == 1  # fewer: asked for
    tensors = {k: v for k, v in load_file(out / "model.safetensors").items() if "layers.3." not in k}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert _job({"init_from": str(out)}).model.mtp_layers == 1  # config.json says 2, the files hold one
    with pytest.raises(SpecError, match=r"model.mtp_layers.*holds \(1.*model.layers.3.eh_proj.weight.*at most 1"):
        _job({"init_from": str(out), "mtp_layers": 2})


def test_the_planner_counts_the_modules():
    from orchestrator.planning.estimate import stage_expert_params, stage_params
    from workers.spec import WorkerSpec

    fields = {k: v for k, v in MODEL.items() if k != "vocab_size"}
    spec = _job({**fields, "moe": {**MODEL["moe"], "bias_balancing": True}}, {"dp": 2, "ep": 2})
    with torch.device("meta"):
        built = sum(p.numel() for p in build_model(WorkerSpec.from_dict(spec.worker_dict()).model).parameters())
    assert sum(stage_params(spec, 0, 1)) + stage_expert_params(spec, 0, 1) == built
    plain = _job({**fields, "mtp_layers": 0})
    assert sum(stage_params(plain, 0, 1)) < sum(stage_params(spec, 0, 1))


def test_deepseek_v3_with_its_mtp_module_is_the_published_total():
    """685B on the hub: 671B main model and 14B MTP module as stored, which holds its own copy of the 129,280 x
    7,168 embedding and head (shared here, counted once). The hub's count also takes in the FP8 block scales (one
    float per 128 x 128 block, about 0.04B), which a bf16 model has none of."""
    from orchestrator.planning.estimate import mtp_params, stage_expert_params, stage_params

    job = _job({"preset": "deepseek-v3-671b", "mtp_layers": 1}, {"dp": 128, "ep": 64, "device": "cuda"},
               {"global_batch_size": 15360})
    total, module = sum(stage_params(job, 0, 1)) + stage_expert_params(job, 0, 1), sum(mtp_params(job))
    copies = 2 * 129280 * 7168
    assert round((total - module) / 1e9, 2) == 671.03  # the main model's count is unchanged
    assert (total + copies) / 1e9 == pytest.approx(685, abs=0.6)
    assert (module + copies) / 1e9 == pytest.approx(14, abs=0.6)


@pytest.mark.parametrize(("model", "parallel", "train", "message"), [
    ({"arch": "llama", "mtp_layers": 1}, None, None, "model.mtp_layers.*DeepSeek-V3 field"),
    ({"mtp_layers": 1}, {"pp": 2}, {"microbatches": 2}, "model.mtp_layers.*parallel.pp=2.*set parallel.pp: 1"),
    ({"mtp_layers": 1}, {"tp": 2}, None, "model.mtp_layers.*parallel.tp=2.*set parallel.tp: 1"),
    ({"mtp_layers": 1}, None, {"objective": "dpo"}, "model.mtp_layers.*dpo.*set model.mtp_layers: 0"),
    ({"mtp_layers": -1}, None, None, "mtp_layers"),
])
def test_what_mtp_cannot_run_is_refused_by_field(model, parallel, train, message):
    from orchestrator.errors import SpecError

    base = {k: v for k, v in MODEL.items() if k not in ("vocab_size", "mtp_layers")}
    fields = {"d_model": 32, "n_heads": 4, **model} if model.get("arch") == "llama" else {**base, **model}
    with pytest.raises((SpecError, ValueError), match=message):
        _job(fields, parallel, train)
