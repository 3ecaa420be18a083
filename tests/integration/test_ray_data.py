"""A ``ray.data.Dataset`` of token rows trains exactly like the same tokens prepared on disk."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from orchestrator import TrainingJob
from tests.support.jobs import tiny_spec


def test_a_ray_dataset_of_token_rows_trains_like_the_same_prepared_tokens(ray_cluster, token_data, tmp_path):
    import ray.data

    shards = sorted(token_data.glob("shard-*.parquet"))
    tokens = np.concatenate([pq.read_table(f).column("tokens").to_numpy() for f in shards])
    rows = [{"tokens": part} for part in np.array_split(tokens, 37)]  # uneven rows, as documents come
    dataset = ray.data.from_items(rows)
    on_disk = TrainingJob(tiny_spec(token_data, tmp_path / "disk", train={"steps": 3}), progress=False).run()
    spec = tiny_spec(tmp_path / "unused", tmp_path / "ray", train={"steps": 3})
    job = TrainingJob(spec, progress=False, dataset=dataset)
    from_rows = job.run()
    assert job.spec.data.path == str((tmp_path / "ray" / "run" / "ray_data").resolve())
    assert from_rows.losses == on_disk.losses  # same stream, same windows, same order
