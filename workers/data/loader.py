"""Deterministic, resumable sample stream over prepared token shards (bytes, or any tokenizer's ids).

The global order (epoch permutations seeded by [seed, epoch]) is independent of the
data-parallel layout; ranks only pick contiguous slices of it. Hence a checkpoint's
`position` alone says which samples were consumed, whatever dp size resumes it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from workers.data import checksums
from workers.data.prepare import FORMAT
from workers.parallel.context_layout import split_sequence

_MISSING_HINT = "run `raymesh prepare-data --out PATH` first or set data.path"


def _load_tokens(root: Path, manifest: dict) -> np.ndarray:
    """All shard tokens as one contiguous array, in the manifest's ``dtype`` (uint8 for bytes).

    Windows straddle row-group and shard boundaries, so a single buffer keeps the gather
    in `batch` one fancy-index. With a single Arrow chunk the array is a zero-copy view of
    the decoded column; otherwise chunks are concatenated once (1-4 bytes/token, e.g. 20 MB
    for the default byte corpus), which is cheaper than per-window chunk bookkeeping.
    """
    chunks: list[np.ndarray] = []
    for shard in manifest["shards"]:
        checksums.verify_shard(root, shard)
        table = pq.read_table(root / shard["file"], columns=["tokens"], memory_map=True)
        part = [c.to_numpy(zero_copy_only=True) for c in table.column("tokens").chunks]
        if sum(len(c) for c in part) != shard["tokens"]:
            raise ValueError(f"shard {root / shard['file']} does not match its manifest entry")
        chunks.extend(part)
    tokens = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    if len(tokens) != manifest["total_tokens"]:
        raise ValueError(f"{root}/manifest.json total_tokens disagrees with its shards")
    return tokens


class TokenDataset:
    """Non-overlapping `seq_len + 1` windows (sharing one boundary token) over the token stream."""

    def __init__(self, path: str | Path, seq_len: int, seed: int) -> None:
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            raise FileNotFoundError(f"no prepared data at {manifest_path}; {_MISSING_HINT}")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size: int = manifest["vocab_size"]
        self.tokens = _load_tokens(self.path, manifest)
        self._num_samples = (len(self.tokens) - 1) // seq_len
        if self._num_samples == 0:
            raise ValueError(
                f"seq_len={seq_len} needs at least {seq_len + 1} tokens but {self.path} "
                f"has {len(self.tokens)}; lower seq_len or prepare more data"
            )
        self._epoch_order = lru_cache(maxsize=2)(self._compute_epoch_order)

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def _compute_epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self._num_samples)

    def global_sample_ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids at positions [start, start+count) of the stream epoch0, epoch1, ..."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be non-negative, got {start}, {count}")
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, index = np.divmod(positions, self._num_samples)
        ids = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            ids[mask] = self._epoch_order(int(epoch))[index[mask]]
        return ids

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [count, seq_len], for stream positions [start, start+count)."""
        ids = self.global_sample_ids(start, count)
        offsets = ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        windows = torch.from_numpy(self.tokens[offsets].astype(np.int64))
        return windows[:, :-1], windows[:, 1:]


class DataCursor:
    """One data-parallel rank's view: each step consumes `global_batch` stream positions.

    Under context parallelism (`cp_size` > 1) the rank keeps only its cp share of each sequence, inputs and
    targets alike (`workers.parallel.context_layout.split_sequence`); the position still counts whole samples,
    so a checkpoint resumes at any cp degree.
    """

    def __init__(
        self, dataset: TokenDataset, global_batch: int, dp_rank: int, dp_size: int, position: int = 0,
        cp_rank: int = 0, cp_size: int = 1,
    ) -> None:
        if global_batch <= 0 or dp_size <= 0 or global_batch % dp_size:
            raise ValueError(
                f"global_batch={global_batch} must be a positive multiple of dp_size={dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
        if position < 0:
            raise ValueError(f"position must be non-negative, got {position}")
        self.dataset = dataset
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.position = position
        self.cp_rank, self.cp_size = cp_rank, cp_size

    @property
    def start(self) -> int:
        """Stream position of this rank's first sample in the next step."""
        return self._start

    @property
    def _start(self) -> int:
        return self.position + self.dp_rank * (self.global_batch // self.dp_size)

    def sample_ids_for_step(self) -> np.ndarray:
        """Ids this rank's next `next_batch` will return (for auditing coverage)."""
        return self.dataset.global_sample_ids(self._start, self.global_batch // self.dp_size)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.dataset.batch(self._start, self.global_batch // self.dp_size)
        self.position += self.global_batch
        return (split_sequence(inputs, self.cp_size, self.cp_rank),
                split_sequence(targets, self.cp_size, self.cp_rank))

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "seed": self.dataset.seed,
            "seq_len": self.dataset.seq_len,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore position; global_batch may differ (position counts samples, not steps)."""
        for key in ("seed", "seq_len"):
            mine = getattr(self.dataset, key)
            if state[key] != mine:
                raise ValueError(f"data checkpoint {key}={state[key]} does not match dataset {key}={mine}")
        if state["position"] < 0:
            raise ValueError(f"checkpoint position must be non-negative, got {state['position']}")
        self.position = int(state["position"])
