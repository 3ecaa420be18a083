"""Each router against its paper's formula written out here token by token; the dropless top-k layer against
``transformers``' Mixtral block; drops counted exactly; expert choice's fixed load; the step figures.

The references below loop over tokens and experts in plain Python (float64 via ``math``), independently of
``workers.model.moe``'s batched tensor code; the random draws (noise, random routing) are the inputs both share.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from workers.model import moe
from workers.model.config import ModelConfig, MoEConfig

E, D, N, B = 4, 8, 12, 2  # experts, width, tokens per sequence, sequences


def _router(name: str, **fields) -> moe.Router:
    cfg = MoEConfig(experts=E, router=name, aux_loss_weight=0.1, z_loss_weight=0.01, **fields)
    router = moe.ROUTER_CLASSES[name](cfg, D)
    gen = torch.Generator().manual_seed(7)
    for p in router.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    return router


def _inputs() -> torch.Tensor:
    return torch.randn(B, N, D, generator=torch.Generator().manual_seed(3))


def _noise() -> moe.SequenceNoise:
    return moe.SequenceNoise(seed=5, layer=1, first_sequence=10, batch=B, seq_len=N)


def _assignments(routing: moe.Routing) -> dict[tuple[int, int], float]:
    return {(int(t), int(e)): float(g) for t, e, g in zip(routing.token, routing.expert, routing.gate, strict=True)}


def _scores(x: torch.Tensor, weight: torch.Tensor) -> list[list[list[float]]]:
    """Per sequence, per token, per expert: x · w_e in float64."""
    return [[[sum(float(a) * float(b) for a, b in zip(tok, w, strict=True)) for w in weight.detach()] for tok in seq]
            for seq in x]


def _softmax(v: list[float]) -> list[float]:
    m = max(v)
    ex = [math.exp(a - m) for a in v]
    return [a / sum(ex) for a in ex]


def _ranked(v: list[float]) -> list[int]:
    return sorted(range(len(v)), key=lambda i: -v[i])


def _fill(wanted: list[list[int | None]], capacity: int | None) -> set[tuple[int, int]]:
    """Kept (token, expert) pairs: first choices of all tokens queue before second choices, earlier tokens first."""
    load, kept = [0] * E, set()
    for rank in range(len(wanted[0])):
        for t, choices in enumerate(wanted):
            e = choices[rank]
            if e is not None and (capacity is None or load[e] < capacity):
                load[e] += 1
                kept.add((t, e))
    return kept


def _z_loss(scores) -> float:
    values = [math.log(sum(math.exp(a) for a in tok)) ** 2 for seq in scores for tok in seq]
    return 0.01 * sum(values) / len(values)


def _check(routing: moe.Routing, expected: dict, losses: dict[str, float]) -> None:
    got = _assignments(routing)
    assert set(got) == set(expected)
    for key, gate in expected.items():
        assert got[key] == pytest.approx(gate, rel=1e-5)
    assert set(routing.losses) == set(losses)
    for name, value in losses.items():
        assert float(routing.losses[name]) == pytest.approx(value, rel=1e-4), name


def test_switch_top1_capacity_drops_and_balance_loss():
    router, x = _router("switch", capacity_factor=1.0), _inputs()
    routing = router(x, _noise())
    scores = _scores(x, router.weight)
    capacity = math.ceil(1.0 * N / E)
    expected, balance = {}, []
    for s, seq in enumerate(scores):
        probs = [_softmax(tok) for tok in seq]
        best = [_ranked(p)[0] for p in probs]
        for t, e in _fill([[b] for b in best], capacity):
            expected[(s * N + t, e)] = probs[t][e]
        f = [best.count(i) / N for i in range(E)]
        p = [sum(pr[i] for pr in probs) / N for i in range(E)]
        balance.append(0.1 * E * sum(fi * pi for fi, pi in zip(f, p, strict=True)))
    _check(routing, expected, {"balance": statistics.fmean(balance), "z": _z_loss(scores)})
    assert float(routing.stats["dropped"]) == B * N - len(expected)


def test_gshard_top2_random_second_expert_capacity_and_aux_loss():
    router, x, noise = _router("gshard", capacity_factor=1.0), _inputs(), _noise()
    routing = router(x, noise)
    u = noise.uniform(torch.device("cpu")).view(B, N)
    scores = _scores(x, router.weight)
    capacity = math.ceil(1.0 * 2 * N / E)
    expected, aux = {}, []
    for s, seq in enumerate(scores):
        probs = [_softmax(tok) for tok in seq]
        wanted, gates = [], {}
        for t, p in enumerate(probs):
            e1, e2 = _ranked(p)[:2]
            g1, g2 = p[e1] / (p[e1] + p[e2]), p[e2] / (p[e1] + p[e2])
            gates[t, e1], gates[t, e2] = g1, g2
            wanted.append([e1, e2 if 2 * g2 > float(u[s, t]) else None])
        for t, e in _fill(wanted, capacity):
            expected[(s * N + t, e)] = gates[t, e]
        c = [sum(w[0] == i for w in wanted) for i in range(E)]
        m = [sum(p[i] for p in probs) / N for i in range(E)]
        aux.append(0.1 * statistics.fmean(c[i] / N * m[i] for i in range(E)))
    assert any(w[1] is None for w in wanted)  # random routing did skip some second experts
    _check(routing, expected, {"balance": statistics.fmean(aux), "z": _z_loss(scores)})


def test_noisy_topk_gates_importance_and_load_losses():
    router, x, noise = _router("noisy_topk", top_k=2), _inputs(), _noise()
    routing = router(x, noise)
    eps = noise.normal(E, torch.device("cpu")).view(B, N, E)
    clean, raw_std = _scores(x, router.weight), _scores(x, router.noise_weight)
    expected, importance, load = {}, [], []
    phi = statistics.NormalDist().cdf
    for s in range(B):
        imp, ld = [0.0] * E, [0.0] * E
        for t in range(N):
            std = [math.log1p(math.exp(a)) for a in raw_std[s][t]]
            h = [clean[s][t][i] + float(eps[s, t, i]) * std[i] for i in range(E)]
            top = _ranked(h)[:2]
            gates = _softmax([h[i] for i in top])
            for e, g in zip(top, gates, strict=True):
                expected[(s * N + t, e)] = g
                imp[e] += g
            for i in range(E):
                others = sorted((h[j] for j in range(E) if j != i), reverse=True)
                ld[i] += phi((clean[s][t][i] - others[1]) / std[i])  # kth greatest excluding i, k = 2
        importance.append(0.1 * statistics.pvariance(imp) / statistics.fmean(imp) ** 2)
        load.append(0.1 * statistics.pvariance(ld) / statistics.fmean(ld) ** 2)
    _check(routing, expected, {"importance": statistics.fmean(importance), "load": statistics.fmean(load),
                               "z": _z_loss(clean)})


def test_topk_renormalised_gates_bias_picks_and_balance_loss():
    router, x = _router("topk", top_k=2, bias_balancing=True), _inputs()
    router.bias = torch.tensor([0.0, 0.3, 0.0, -0.3])
    routing = router(x, _noise())
    scores = _scores(x, router.weight)
    expected, balance = {}, []
    for s, seq in enumerate(scores):
        probs = [_softmax(tok) for tok in seq]
        chosen = [_ranked([p[i] + float(router.bias[i]) for i in range(E)])[:2] for p in probs]
        for t, (p, top) in enumerate(zip(probs, chosen, strict=True)):
            for e in top:  # the bias picks, the unbiased probabilities weigh
                expected[(s * N + t, e)] = p[e] / sum(p[i] for i in top)
        f = [sum(i in top for top in chosen) / N for i in range(E)]
        mean_p = [sum(p[i] for p in probs) / N for i in range(E)]
        balance.append(0.1 * E * sum(f[i] * mean_p[i] for i in range(E)))
    _check(routing, expected, {"balance": statistics.fmean(balance), "z": _z_loss(scores)})
    assert float(routing.stats["dropped"]) == 0  # dropless


def test_expert_choice_gives_every_expert_exactly_k_tokens():
    router, x = _router("expert_choice", capacity_factor=2.0), _inputs()
    routing = router(x, _noise())
    k = int(N * 2.0 / E)
    scores = _scores(x, router.weight)
    expected = {}
    for s, seq in enumerate(scores):
        probs = [_softmax(tok) for tok in seq]
        for e in range(E):
            for t in _ranked([p[e] for p in probs])[:k]:
                expected[(s * N + t, e)] = probs[t][e]
    _check(routing, expected, {"z": _z_loss(scores)})
    assert routing.stats["tokens_per_expert"].tolist() == [B * k] * E
    for s in range(B):
        in_seq = (routing.token >= s * N) & (routing.token < (s + 1) * N)
        assert torch.bincount(routing.expert[in_seq], minlength=E).tolist() == [k] * E
    assert float(routing.stats["dropped"]) == B * N - len({t for t, _ in expected})


def test_drops_are_counted_exactly_and_dropped_tokens_output_zero():
    """Every token prefers expert 0: per sequence of N tokens with capacity ceil(1.0 * N / E), exactly
    N - capacity are dropped, and their MoE output is zero (the residual carries them)."""
    cfg = ModelConfig(d_model=D, d_ff=16, n_layers=1, n_heads=2,
                      moe={"experts": E, "router": "switch", "capacity_factor": 1.0})
    layer = moe.MoELayer(cfg, 0, swiglu=False)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = torch.rand(B, N, D) + 0.5  # positive, so expert 0 scores highest for every token
    moe.begin_step([layer], seed=0, first_sequence=0, aux_scale=1.0)
    out = layer(x)
    capacity = math.ceil(N / E)
    assert layer.tally["dropped"].item() == B * (N - capacity)
    assert layer.tally["tokens_per_expert"].tolist() == [B * capacity, 0, 0, 0]
    assert torch.all(out[:, capacity:] == 0) and torch.all(out[:, :capacity].abs().sum(-1) > 0)
    figures = moe.end_step([layer], None)[""]
    assert figures["drop_fraction"] == pytest.approx((N - capacity) / N)
    assert figures["balance"] == pytest.approx(E)  # max / mean load: all on one expert


def test_topk_layer_matches_mixtral_sparse_moe_block():
    """The dropless top-k SwiGLU layer against transformers' Mixtral block on the same weights: outputs, and
    the balance loss against transformers' load_balancing_loss_func."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

    hidden = 24
    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=D * 2, intermediate_size=hidden, num_local_experts=E,
                                             num_experts_per_tok=2)).eval()
    gen = torch.Generator().manual_seed(11)
    for p in hf.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    cfg = ModelConfig(arch="llama", d_model=D * 2, d_ff=hidden, n_layers=1, n_heads=2,
                      moe={"experts": E, "router": "topk", "top_k": 2, "group": "microbatch", "aux_loss_weight": 1.0})
    ours = moe.MoELayer(cfg, 0, swiglu=True).eval()
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        gate_up = hf.experts.gate_up_proj
        ours.experts.w1.copy_(gate_up[:, :hidden].transpose(1, 2))
        ours.experts.w3.copy_(gate_up[:, hidden:].transpose(1, 2))
        ours.experts.w2.copy_(hf.experts.down_proj.transpose(1, 2))
    x = torch.randn(B, N, D * 2, generator=gen)
    moe.begin_step([ours], seed=0, first_sequence=0, aux_scale=1.0)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)
    logits = hf.gate(x.view(-1, D * 2))[0]
    expected = load_balancing_loss_func((logits,), E, 2)
    assert float(ours.tally["loss_balance"]) == pytest.approx(float(expected), rel=1e-5)


def test_noise_depends_on_the_sequence_not_the_split():
    """Sequence 11's draws are the same whether it is a microbatch's first or second sequence."""
    whole = moe.SequenceNoise(seed=1, layer=3, first_sequence=10, batch=2, seq_len=N).normal(E, torch.device("cpu"))
    alone = moe.SequenceNoise(seed=1, layer=3, first_sequence=11, batch=1, seq_len=N).normal(E, torch.device("cpu"))
    assert torch.equal(whole[N:], alone)
    other_layer = moe.SequenceNoise(seed=1, layer=4, first_sequence=11, batch=1, seq_len=N)
    assert not torch.equal(alone, other_layer.normal(E, torch.device("cpu")))


def test_aux_loss_reaches_the_router_gradient_and_recompute_is_not_counted_twice():
    cfg = ModelConfig(d_model=D, d_ff=16, n_layers=1, n_heads=2, moe={"experts": E, "router": "switch",
                                                                     "aux_loss_weight": 1.0})
    layer = moe.MoELayer(cfg, 0, swiglu=False)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    x = torch.randn(B, N, D)
    moe.begin_step([layer], seed=0, first_sequence=0, aux_scale=0.5)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    with_aux = layer.router.weight.grad.clone()
    assert layer.tally["microbatches"].item() == 1  # the recompute in backward added nothing
    layer.zero_grad()
    moe.begin_step([layer], seed=0, first_sequence=0, aux_scale=0.0)
    layer(x).sum().backward()
    torch.testing.assert_close(with_aux - layer.router.weight.grad, _aux_grad(layer, x, 0.5))


def _aux_grad(layer: moe.MoELayer, x: torch.Tensor, scale: float) -> torch.Tensor:
    weight = layer.router.weight.detach().clone().requires_grad_(True)
    probs = (x.view(B, N, D) @ weight.t()).softmax(-1)
    f = torch.nn.functional.one_hot(probs.argmax(-1), E).float().mean(1)
    (scale * E * (f * probs.mean(1)).sum(-1).mean()).backward()
    return weight.grad


def test_bias_moves_against_the_sign_of_the_load_error():
    router = _router("topk", bias_balancing=True, bias_update_rate=0.01)
    router.bias.zero_()
    router.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert router.bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


def test_switch_init_is_truncated_normal_with_scale_point_one_and_noisy_topk_starts_at_zero():
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, moe={"experts": 8, "router": "switch"})
    gen = torch.Generator().manual_seed(0)
    router = moe.moe_parameter("layers.0.feed_forward.router.weight", (8, 64), gen, cfg)
    w2 = moe.moe_parameter("layers.0.feed_forward.experts.w2", (8, 256, 64), gen, cfg)
    for value, fan_in in ((router, 64), (w2, 256)):
        std = math.sqrt(0.1 / fan_in)
        assert value.abs().max() <= 2 * std and 0.7 * std < value.std() < std
    noisy = cfg.model_copy(update={"moe": MoEConfig(experts=8, router="noisy_topk")})
    assert not moe.moe_parameter("layers.0.feed_forward.router.noise_weight", (8, 64), gen, noisy).any()


def test_a_slice_of_the_experts_is_drawn_as_the_same_rows_of_the_whole():
    """Meta-device init of an Experts module holding experts 2..3 of 4 gives rows 2..3 of the whole stack, as
    expert parallelism needs (the stack is drawn whole from its name's generator, then cut)."""
    from workers.model.meta_init import fill

    cfg = ModelConfig(d_model=D, d_ff=16, n_layers=1, n_heads=2, moe={"experts": E})
    whole = moe.MoELayer(cfg, 0, swiglu=False)
    fill(whole, 9, cfg)
    part = moe.MoELayer(cfg, 0, swiglu=False)
    part.experts.first, part.experts.num_local = 2, 2
    part.experts.w1 = torch.nn.Parameter(torch.empty(2, D, 16))
    part.experts.w2 = torch.nn.Parameter(torch.empty(2, 16, D))
    fill(part, 9, cfg)
    assert torch.equal(part.experts.w1, whole.experts.w1[2:]) and torch.equal(part.experts.w2, whole.experts.w2[2:])
