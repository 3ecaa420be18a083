"""The rows of a ``ray.data.Dataset`` handed to a job: each must be a list of integer token ids (no Ray here:
a stand-in yields the numpy batches ``Dataset.iter_batches`` gives)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.errors import SpecError
from orchestrator.runtime.ray_data import dataset_rows


class Batches:
    """What ``iter_batches(batch_format="numpy")`` yields: one dict of column arrays per batch."""

    def __init__(self, *batches: dict):
        self.batches = batches

    def iter_batches(self, batch_format: str, batch_size: int):
        assert batch_format == "numpy"
        return iter(self.batches)


def ragged(*rows) -> np.ndarray:
    """A column of variable-length lists, as numpy batches hold one: an object array of arrays."""
    out = np.empty(len(rows), dtype=object)
    out[:] = [np.asarray(r, dtype=np.int64) for r in rows]
    return out


def test_ragged_and_fixed_rows_of_ids_pass_through_in_order():
    data = Batches({"tokens": ragged([1, 2, 3], [], [4])}, {"tokens": np.array([[5, 6], [7, 8]])})
    assert [r.tolist() for r in dataset_rows(data, "tokens")] == [[1, 2, 3], [], [4], [5, 6], [7, 8]]


@pytest.mark.parametrize("column, held", [
    (np.array([3, 4, 5]), "single int64 values"),  # one id per row: a scalar column
    (np.array(["the cat", "sat"]), "single <U7 values"),  # text, not tokens
    (np.array([[0.5, 1.0]]), "lists of float64"),
    (np.zeros((1, 2, 2), dtype=np.int64), "2-D arrays"),
])
def test_rows_that_are_not_lists_of_integer_ids_are_refused_naming_what_the_column_holds(column, held):
    with pytest.raises(SpecError) as info:
        list(dataset_rows(Batches({"tokens": column}), "tokens"))
    err = info.value
    assert err.field == "dataset" and err.value == f"column 'tokens' of {held}" and "token ids" in err.fix
