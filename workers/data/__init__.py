"""Byte-level token data: turn text trees into Parquet shards and stream them deterministically.

The global sample order depends only on (seed, seq_len), never on the data-parallel
layout, so checkpoints can be resumed at a different dp size without re-seeing data.
"""

import importlib

_HOME = {"DataCursor": "loader", "MixedDataset": "loader", "TokenDataset": "loader", "open_data": "loader",
         "default_sources": "prepare", "prepare_data": "prepare", "write_token_rows": "prepare"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    """The package's names, each imported from its module on first use: the loader imports torch (seconds of
    CPU), which preparing data and the controller (it writes Ray Data rows) never need."""
    if name not in _HOME:
        raise AttributeError(f"module 'workers.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"workers.data.{_HOME[name]}"), name)
