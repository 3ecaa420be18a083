"""``model.attention_mask: document``: what it refuses before start, each refusal naming the field, the value and
the fix, and what it accepts."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec
from orchestrator.spec.runtime_checks import check_before_start
from tests.support.spec_errors import assert_actionable, spec_error
from workers.data import prepare_data, write_token_rows

DOCUMENT = {"model": {"attention_mask": "document", "seq_len": 8}, "train": {"global_batch_size": 2},
            "data": {"path": "data"}}


def _raw(run_dir: str = "runs", **sections) -> dict:
    raw = {k: dict(v) for k, v in DOCUMENT.items()}
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    return {**raw, "run_dir": run_dir}


REFUSED = {  # name: (sections, field, value, a part of the fix)
    "pipedream": ({"parallel": {"pp": 2, "pp_schedule": "pipedream"}, "train": {"microbatches": 2}},
                  "parallel.pp_schedule", "pipedream",
                  "use pp_schedule: 1f1b"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_document_mask_cannot_combine_with_is_refused_naming_the_fix(name):
    sections, field, value, fix = REFUSED[name]
    msg = assert_actionable(spec_error(_raw(**sections)), field, value, fix, "model.attention_mask: causal")
    assert "model.attention_mask: document" in msg or "mask by document" in msg


@pytest.mark.parametrize("parallel", [{"cp": 2, "cp_impl": "allgather"}, {"cp": 2, "cp_impl": "ulysses"},
                                      {"cp": 2, "cp_impl": "ring"}, {"cp": 2}, {"pp": 2, "dp": 2, "tp": 2}])
def test_the_layouts_it_masks_are_accepted(parallel):
    raw = _raw(parallel=parallel, train={"global_batch_size": 4, "microbatches": 2})
    assert JobSpec.from_dict(raw).model.attention_mask == "document"


def test_learned_positions_are_accepted_restarting_at_each_document():
    raw = _raw(model={"positions": "learned"}, parallel={"cp": 2})
    assert JobSpec.from_dict(raw).model.positions == "learned"


def test_the_default_is_causal_and_ring_stays_allowed_with_it():
    raw = _raw(parallel={"cp": 2, "cp_impl": "ring"})
    raw["model"].pop("attention_mask")
    assert JobSpec.from_dict(raw).model.attention_mask == "causal"


def test_an_unknown_mask_is_refused_naming_the_field():
    err = spec_error(_raw(model={"attention_mask": "block_causal"}))
    assert err.field == "model.attention_mask"


def _bare_rows(out) -> str:
    """Ids written as bare rows (a Ray dataset's): the manifest records no end-of-document id."""
    rows = [np.arange(1, 40) % 250 + 1 for _ in range(4)]
    write_token_rows(iter(rows), out, vocab_size=256, source="test")
    return str(out)


def _prepared(tmp_path) -> str:
    (tmp_path / "src").mkdir()
    for i in range(4):
        (tmp_path / "src" / f"{i}.txt").write_text("doc " * (10 + i))
    prepare_data([tmp_path / "src"], tmp_path / "prepared")
    return str(tmp_path / "prepared")


@pytest.mark.parametrize("field", ["data.path", "eval.path"])
def test_data_without_an_end_of_document_id_is_refused_before_start(field, tmp_path):
    prepared, bare = _prepared(tmp_path), _bare_rows(tmp_path / "rows")
    paths = {"data.path": bare, "eval.path": prepared} if field == "data.path" else \
        {"data.path": prepared, "eval.path": bare}
    spec = JobSpec.from_dict(_raw(data={"path": paths["data.path"]}, run_dir=str(tmp_path / "run"),
                                  eval={"path": paths["eval.path"], "every": 1, "batches": 1}))
    with pytest.raises(SpecError) as info:
        check_before_start(spec)
    msg = assert_actionable(info.value, "model.attention_mask", "document", "raymesh prepare-data",
                            "model.attention_mask: causal")
    assert f"{field} {bare}" in msg and "records none" in msg


def test_prepared_data_records_its_end_of_document_id_and_passes(tmp_path):
    prepared = _prepared(tmp_path)
    check_before_start(JobSpec.from_dict(_raw(data={"path": prepared}, run_dir=str(tmp_path / "run"))))
