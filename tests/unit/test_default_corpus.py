"""``raymesh run`` prepares the default corpus a job names when it is missing, and nothing else."""

from __future__ import annotations

import json
import logging
import sysconfig
from pathlib import Path

import pytest

from orchestrator import JobSpec
from orchestrator.cli import default_corpus
from orchestrator.cli.default_corpus import names_default_corpus, prepare_default_corpus
from orchestrator.spec import check_before_start


def test_only_a_missing_or_empty_directory_named_like_the_default_corpus_counts(tmp_path):
    assert names_default_corpus(tmp_path / "data" / "stdlib")
    assert names_default_corpus(tmp_path / "stdlib-bpe")
    (tmp_path / "empty" / "stdlib").mkdir(parents=True)
    assert names_default_corpus(tmp_path / "empty" / "stdlib")
    (tmp_path / "full" / "stdlib").mkdir(parents=True)
    (tmp_path / "full" / "stdlib" / "mine.txt").write_text("keep")
    assert not names_default_corpus(tmp_path / "full" / "stdlib")  # never written over
    assert not names_default_corpus(tmp_path / "my-corpus")  # a typo stays an error naming data.path


def test_a_missing_default_corpus_is_prepared_with_a_log_line_and_passes_the_pre_start_checks(
        tmp_path, monkeypatch, caplog):
    json_package = Path(sysconfig.get_paths()["stdlib"]) / "json"  # the default corpus in small: same code path
    monkeypatch.setattr("workers.data.prepare.default_sources", lambda: [json_package])
    spec = JobSpec.from_dict({"data": {"path": str(tmp_path / "data" / "stdlib")}, "run_dir": str(tmp_path / "run")})
    logger = logging.getLogger("raymesh")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="raymesh"):
        assert prepare_default_corpus(spec)
    manifest = json.loads((tmp_path / "data" / "stdlib" / "manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == default_corpus.DEFAULT_CORPORA["stdlib"] and manifest["total_tokens"] > 0
    assert any("event=prepare_data" in r.getMessage() and "default corpus" in r.getMessage() for r in caplog.records)
    check_before_start(spec)  # what `raymesh run` checks next: the prepared data is accepted
    assert not prepare_default_corpus(spec)  # there now: prepared once


def test_another_missing_path_is_left_to_the_check_that_names_the_fix(tmp_path):
    spec = JobSpec.from_dict({"data": {"path": str(tmp_path / "nowhere")}, "run_dir": str(tmp_path / "run")})
    assert not prepare_default_corpus(spec)
    with pytest.raises(Exception, match=r"data.path.*raymesh prepare-data --out"):
        check_before_start(spec)
