"""A benchmark's JSON says which corpus and machine its figures came from (``benchmarks/provenance.py``).

The default corpus is the preparing interpreter's standard library, so the same command gives other losses on
another Python; the corpus digest is what tells two runs' figures apart.
"""

from __future__ import annotations

import json

import torch

from benchmarks.provenance import corpus, write_result
from workers.data.prepare import prepare_data


def _corpus(tmp_path, name: str, text: bytes):
    src = tmp_path / f"{name}-src"
    src.mkdir()
    (src / "a.txt").write_bytes(text)
    prepare_data([src], tmp_path / name)
    return tmp_path / name


def test_the_digest_tells_corpora_apart_and_repeats_for_the_same_one(tmp_path):
    one = _corpus(tmp_path, "one", b"def f():\n    return 1\n" * 50)
    same = _corpus(tmp_path, "same", b"def f():\n    return 1\n" * 50)
    other = _corpus(tmp_path, "other", b"def f():\n    return 2\n" * 50)
    assert corpus(one)["digest"] == corpus(same)["digest"]
    assert corpus(one)["digest"] != corpus(other)["digest"]
    assert corpus(one)["total_tokens"] == 1100 and corpus(one)["tokenizer"] == "bytes"


def test_the_written_result_keeps_its_rows_and_names_the_machine(tmp_path):
    data = _corpus(tmp_path, "one", b"x = 1\n" * 10)
    write_result(tmp_path / "rows.json", [{"loss": 2.5}], data)
    written = json.loads((tmp_path / "rows.json").read_text())
    assert written["rows"] == [{"loss": 2.5}]
    assert written["provenance"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert written["provenance"]["corpus"]["sources"] == [str((tmp_path / "one-src").resolve())]
    write_result(tmp_path / "report.json", {"overlap": 1})
    assert set(json.loads((tmp_path / "report.json").read_text())) == {"overlap", "provenance"}
