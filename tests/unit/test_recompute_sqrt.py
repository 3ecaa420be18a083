"""``memory.recompute: sqrt`` as Chen et al. 2016 define it (seed 000 lines 405-415, 001 lines 221-225): the ℓ
blocks cut into d segments, only each segment's input stored, each segment recomputed whole in backward, so
training keeps O(ℓ/d) + O(d) activations, least at d = √ℓ.

One process, the tiny GPT: ``ActivationMeter`` counts the bytes saved for backward in a forward (what stays
stored) and, run over one segment's blocks without recompute, what backward rebuilds for a segment; the memory
model predicts both, and the sum follows (ℓ/d)·block + d·input + head exactly, least at d = √ℓ.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.errors import SpecError
from orchestrator.planning.estimate import head_bytes, layer_bytes, recompute_working_bytes
from tests.support.jobs import tiny_spec
from tests.support.recompute import measured_saved_bytes, predicted_saved_bytes
from workers.diagnostics.memory_probe import ActivationMeter
from workers.model.gpt import GPT, lm_loss
from workers.model.registry import family, model_config
from workers.parallel.recompute import apply_recompute, checkpointed_modules


def _spec(token_data, tmp_path, recompute: str, every: int = 1, layers: int = 9):
    return tiny_spec(token_data, tmp_path, model={"n_layers": layers}, train={"microbatches": 1},
                     memory={"recompute": recompute, "recompute_every": every})


def _model(spec, policy: str, length: int) -> GPT:
    torch.manual_seed(0)
    gpt = GPT(model_config(spec.worker_dict()["model"]))
    apply_recompute(gpt, policy, family("gpt"), length)
    return gpt


def _tokens(spec) -> torch.Tensor:
    return torch.randint(0, spec.model.vocab_size, (spec.train.global_batch_size, spec.model.seq_len),
                         generator=torch.Generator().manual_seed(1))


def _stored(spec, length: int) -> int:
    """Bytes saved for backward by a forward under segments of ``length`` blocks."""
    gpt = _model(spec, "sqrt", length)
    with ActivationMeter([gpt], checkpointed_modules(gpt, "sqrt", family("gpt"), length)) as meter:
        loss = lm_loss(gpt(_tokens(spec)), _tokens(spec))
    loss.backward()
    return meter.peak


def _rebuilt(spec, length: int) -> int:
    """What backward holds when it recomputes one segment: ``length`` blocks' activations, nothing recomputed."""
    gpt = _model(spec, "none", 1)
    hidden = gpt.tok_embeddings(_tokens(spec)).detach().requires_grad_()
    with ActivationMeter([gpt], []) as meter:
        for i in range(length):
            hidden = gpt.layers[str(i)](hidden)
    return meter.peak


@pytest.mark.parametrize("layers", [4, 9, 16])
def test_sqrt_stores_one_input_per_segment_and_the_model_follows(token_data, tmp_path, layers):
    spec = _spec(token_data, tmp_path, "sqrt", layers=layers)
    worker = spec.worker_dict()["memory"]
    length = round(layers ** 0.5)
    assert (worker["recompute"], worker["recompute_every"]) == ("sqrt", length)
    measured = measured_saved_bytes(spec)
    assert predicted_saved_bytes(spec) == pytest.approx(measured, rel=0.01)
    one_input = 4 * spec.train.global_batch_size * spec.model.seq_len * spec.model.d_model
    assert measured - head_bytes(spec) == pytest.approx(layers // length * one_input, rel=0.01)
    # backward rebuilds one segment at a time: the model's working set is one segment's, as measured
    assert recompute_working_bytes(spec, list(range(layers))) == pytest.approx(_rebuilt(spec, length), rel=0.01)


def test_memory_is_l_over_d_plus_d_and_least_where_the_formula_says(token_data, tmp_path):
    """ℓ = 64 blocks in d = 1 ... 64 segments: stored + rebuilt = (ℓ/d)·block + d·input + head, measured. Chen's
    d = √ℓ is the least for unit costs (block = input); a transformer block saves c = block/input times its input
    (c ≈ 14 here), which moves the least to d = √(c·ℓ) ≈ 30: between the ends, where the formula puts it."""
    layers = 64
    spec = _spec(token_data, tmp_path, "sqrt", layers=layers)
    block, head = _rebuilt(spec, 1), head_bytes(spec)
    one_input = 4 * spec.train.global_batch_size * spec.model.seq_len * spec.model.d_model
    total, formula = {}, {}
    for d in (1, 2, 4, 8, 16, 32, 64):
        total[d] = _stored(spec, layers // d) + _rebuilt(spec, layers // d)
        formula[d] = layers // d * block + d * one_input + head
        assert total[d] == pytest.approx(formula[d], rel=0.01), d
    least = min(total, key=total.get)
    assert least == min(formula, key=formula.get) == 32 and total[least] < min(total[1], total[64])
    assert round((layers * block / one_input) ** 0.5) in range(least // 2, least * 2)  # √(c·ℓ)


def test_each_segment_is_recomputed_once_in_backward_and_gradients_are_exact(token_data, tmp_path):
    spec = _spec(token_data, tmp_path, "sqrt", layers=9)
    calls = {i: 0 for i in range(9)}
    grads = {}
    for policy, length in (("none", 1), ("sqrt", 3)):
        gpt = _model(spec, policy, length)
        if policy == "sqrt":
            for i in range(9):
                gpt.layers[str(i)].register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
        lm_loss(gpt(_tokens(spec)), _tokens(spec)).backward()
        grads[policy] = {n: p.grad for n, p in gpt.named_parameters()}
    assert calls == {i: 2 for i in range(9)}  # its forward, then its segment's recompute
    for name, grad in grads["none"].items():
        assert torch.equal(grads["sqrt"][name], grad), name


def test_sqrt_checkpoints_segments_0_3_6_of_nine_blocks(token_data, tmp_path):
    worker = _spec(token_data, tmp_path, "sqrt").worker_dict()
    gpt = GPT(model_config(worker["model"]))
    memory = worker["memory"]
    stored = checkpointed_modules(gpt, memory["recompute"], family("gpt"), memory["recompute_every"])
    assert stored == [gpt.layers[str(i)] for i in (0, 3, 6)]


def test_sqrt_with_recompute_every_names_the_fix(token_data, tmp_path):
    with pytest.raises(SpecError, match=r"memory\.recompute_every.*value 2.*fix: remove memory\.recompute_every"):
        _spec(token_data, tmp_path, "sqrt", 2)


def test_sqrt_with_compile_is_refused_naming_the_fix(token_data, tmp_path):
    with pytest.raises(SpecError, match=r"memory\.recompute.*sqrt.*fix: set memory\.recompute: full"):
        tiny_spec(token_data, tmp_path, memory={"recompute": "sqrt"}, train={"compile": True})


def test_the_planner_counts_nothing_inside_a_segment(token_data, tmp_path):
    spec = _spec(token_data, tmp_path, "sqrt", layers=9)
    assert [layer_bytes(spec, i) > 0 for i in range(9)] == [i % 3 == 0 for i in range(9)]
