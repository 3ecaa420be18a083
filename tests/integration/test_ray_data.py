"""A ``ray.data.Dataset`` of token rows trains like the same tokens prepared on disk."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from orchestrator import TrainingJob
from tests.support.jobs import tiny_spec
from tests.support.reference import reference_losses


def test_a_ray_dataset_of_token_rows_trains_like_the_same_prepared_tokens(ray_cluster, token_data, tmp_path):
    import ray.data

    shards = sorted(token_data.glob("shard-*.parquet"))
    tokens = np.concatenate([pq.read_table(f).column("tokens").to_numpy() for f in shards])
    rows = [{"tokens": part} for part in np.array_split(tokens, 37)]  # uneven rows, as documents come
    job = TrainingJob(tiny_spec(tmp_path / "unused", tmp_path, train={"steps": 3}), progress=False,
                      dataset=ray.data.from_items(rows))
    from_rows = job.run()
    assert job.spec.data.path == str((tmp_path / "run" / "ray_data").resolve())
    # the single-process reference reads the prepared directory: same stream, same windows, same order
    assert from_rows.losses == pytest.approx(reference_losses(tiny_spec(token_data, tmp_path / "ref"), 3), rel=1e-4)
