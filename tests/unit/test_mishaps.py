"""Seeded mishaps to data, the raw token cache, checkpoints, Hugging Face directories and tokenizers
(tests/support/mishaps.py): each is refused naming the damaged thing, or (the raw token cache) built again with a
warning naming it, or (a manifest without checksums) named in a warning; none ends in a traceback, none of a
known-bad class is accepted without a word, and no planted pickle runs."""

from __future__ import annotations

import pytest

from tests.support.mishaps import bugs, mishaps, pristine, run, summary


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run(tmp_path_factory.mktemp("mishaps"), seed=29, rounds=2)


def test_every_mishap_is_refused_by_name_or_repaired(outcomes):
    assert not bugs(outcomes), bugs(outcomes)
    counts = summary(outcomes)
    assert counts["refused"] >= 40 and counts["rebuilt"] >= 8 and counts["warned"] >= 2, counts


def test_every_area_and_every_way_in_is_exercised(outcomes):
    assert {o.mishap.area for o in outcomes} == {"data", "raw cache", "checkpoint", "hf", "tokenizer"}
    assert {o.mishap.through for o in outcomes} == {"plan", "plan+loader", "plan+read", "loader", "generate",
                                                    "export-hf"}


def test_mishaps_are_deterministic(tmp_path):
    base = pristine(tmp_path / "p")
    names = [[m.name for m in mishaps(base, seed=5)] for _ in range(2)]
    assert names[0] == names[1] and len(set(names[0])) > 20
