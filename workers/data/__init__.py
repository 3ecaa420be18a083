"""Byte-level token data: turn text trees into Parquet shards and stream them deterministically.

The global sample order depends only on (seed, seq_len), never on the data-parallel
layout, so checkpoints can be resumed at a different dp size without re-seeing data.
"""

from workers.data.loader import DataCursor, TokenDataset
from workers.data.prepare import default_sources, prepare_data, write_token_rows

__all__ = ["DataCursor", "TokenDataset", "default_sources", "prepare_data", "write_token_rows"]
