"""Parallel layouts reproduce the single-process reference without Ray (fp32, CPU, 1e-4 relative).

Ranks are spawned processes over gloo on loopback (tests/support/parity_harness.py), so each layout costs
its training and not Ray's actors and controller. The math of a layout (wrappers, schedules, sharded
optimizers) all lives in ``workers.trainer``; tests/integration/test_parity.py keeps one Ray layout per
axis for what Ray adds on top. These layouts moved here from there (and two LoRA layouts from
tests/integration/test_lora_parity.py), with the same steps and tolerance.
Integration, not unit: spawning the ranks and importing torch in each takes seconds per layout.
"""

from __future__ import annotations

import pytest

from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped
from tests.support.reference import reference_run

STEPS = 10

LAYOUTS = {
    "dp4": {"dp": 4},
    "tp2-no-sp": {"tp": 2, "sequence_parallel": False},
    "tp2-dp2-zero3": {"tp": 2, "dp": 2, "zero": 3},
    "pp2-dp2-gpipe": {"pp": 2, "dp": 2, "pp_schedule": "gpipe"},
    "pp2-dp2-interleaved_1f1b": {"pp": 2, "dp": 2, "pp_schedule": "interleaved_1f1b"},
    "pp2-dp2-interleaved_zero_bubble": {"pp": 2, "dp": 2, "pp_schedule": "interleaved_zero_bubble"},
    "pp2-dp2-zbv": {"pp": 2, "dp": 2, "pp_schedule": "zbv"},
    "pp2-dp2-dualpipev": {"pp": 2, "dp": 2, "pp_schedule": "dualpipev"},
    "pp2-tp2-dp2": {"pp": 2, "tp": 2, "dp": 2},
    "dp2-zero1": {"dp": 2, "zero": 1},
    "dp2-zero2": {"dp": 2, "zero": 2},
    "pp2-dp2-zero3-interleaved": {"pp": 2, "dp": 2, "zero": 3, "pp_schedule": "interleaved_1f1b"},
}

LORA_STEPS = 5
LORA = {"rank": 4, "alpha": 8.0}
# moved from tests/integration/test_lora_parity.py, which keeps dp2-zero3 through Ray
LORA_LAYOUTS = {
    "tp2-sp": ({"tp": 2}, {"targets": ["wq", "wk", "wv", "wo", "w1", "w2", "output"]}),
    "pp2-dp2-zero-bubble": ({"pp": 2, "dp": 2, "pp_schedule": "interleaved_zero_bubble"}, {}),
}


# each layout runs for both families; the Llama (GQA: 4 query heads over 2 K/V heads, SwiGLU) for fewer steps
ARCHS = {"gpt": ({}, STEPS), "llama": ({"arch": "llama", "n_kv_heads": 2}, 4)}
# Llama-only: a tied head re-tied after TP and sharded with the embedding under ZeRO-3
LLAMA_LAYOUTS = {"tp2-dp2-zero3-tied": ({"tp": 2, "dp": 2, "zero": 3}, {"tie_embeddings": True})}
# GPT-only: the learned position table under sequence parallelism, its [1, seq] lookup's output sharded over tokens
GPT_LAYOUTS = {"tp2-sp-learned": ({"tp": 2}, {"positions": "learned"})}


def _spec(arch: str, token_data, tmp_path, parallel: dict, model: dict | None = None, train: dict | None = None):
    fields, steps = ARCHS[arch]
    return tiny_spec(token_data, tmp_path, parallel={**parallel, "device": "cpu"}, model={**fields, **(model or {})},
                     train={"steps": steps, **(train or {})})


def _cases(token_data, tmp_path) -> dict[str, tuple]:
    """Every test's spec and whether it is checked against the plain job's reference (else its own), by test id."""
    cases = {}
    for arch in ARCHS:
        for name, parallel in LAYOUTS.items():
            train = {"microbatches": 4} if parallel.get("pp_schedule") == "dualpipev" else {}
            cases[f"{name}-{arch}"] = (_spec(arch, token_data, tmp_path / f"{name}-{arch}", parallel, train=train),
                                       True)
        for name, (parallel, lora) in LORA_LAYOUTS.items():
            spec = _spec(arch, token_data, tmp_path / f"lora-{name}-{arch}", parallel,
                         model={"lora": {**LORA, **lora}}, train={"steps": LORA_STEPS})
            cases[f"lora-{name}-{arch}"] = (spec, False)
    for arch, layouts in (("llama", LLAMA_LAYOUTS), ("gpt", GPT_LAYOUTS)):
        for name, (parallel, model) in layouts.items():
            cases[f"{arch}-{name}"] = (_spec(arch, token_data, tmp_path / f"{arch}-{name}", parallel, model=model),
                                       False)
    return cases


@pytest.fixture(scope="module")
def cases(token_data, tmp_path_factory):
    return _cases(token_data, tmp_path_factory.mktemp("parity-harness"))


@pytest.fixture(scope="module")
def runs(cases):
    """Every case trained, the layouts of one world size and step count sharing one spawn (``run_grouped``)."""
    return run_grouped({name: spec for name, (spec, _) in cases.items()})


@pytest.fixture(scope="module")
def references(token_data, tmp_path_factory):
    """The single-process reference of the plain tiny job, per family, computed once."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            spec = _spec(arch, token_data, tmp_path_factory.mktemp(f"ref-{arch}"), {})
            cache[arch] = reference_run(spec, spec.train.steps)
        return cache[arch]
    return get


def _assert_matches(name: str, cases, runs, expected) -> None:
    spec = cases[name][0]
    run = ran(runs, name)
    assert len(run.losses) == spec.train.steps
    losses, grad_norms = expected
    assert run.losses == pytest.approx(losses, rel=1e-4)
    assert run.grad_norms == pytest.approx(grad_norms, rel=1e-4)  # the global norm that clipping uses


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process_reference(name, arch, cases, runs, references):
    _assert_matches(f"{name}-{arch}", cases, runs, references(arch))


@pytest.mark.parametrize("name", [f"llama-{n}" for n in LLAMA_LAYOUTS] + [f"gpt-{n}" for n in GPT_LAYOUTS])
def test_one_family_layout_matches_its_single_process_reference(name, cases, runs):
    spec = cases[name][0]
    _assert_matches(name, cases, runs, reference_run(spec, spec.train.steps))


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_layout_matches_single_process_reference(name, arch, cases, runs):
    spec = cases[f"lora-{name}-{arch}"][0]
    _assert_matches(f"lora-{name}-{arch}", cases, runs, reference_run(spec, LORA_STEPS))
