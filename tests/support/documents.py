"""Corpora of many short documents, so that most training windows cross a document boundary and
``model.attention_mask: document`` changes what attention sees (tests of the document mask)."""

from __future__ import annotations

import random
from pathlib import Path


def write_documents(folder: Path, count: int, seed: int) -> None:
    """``count`` text files of 3 to 30 letters: prepare_data joins them with the end-of-document byte."""
    rng = random.Random(seed)
    folder.mkdir()
    for i in range(count):
        text = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(rng.randint(3, 30)))
        (folder / f"{i:04d}.txt").write_text(text)


def short_documents(root: Path, count: int = 300, seed: int = 0) -> Path:
    """``write_documents`` under ``root``, prepared as bytes into ``root / "tokens"``."""
    from workers.data.prepare import prepare_data

    write_documents(root / "src", count, seed)
    prepare_data([root / "src"], root / "tokens")
    return root / "tokens"
