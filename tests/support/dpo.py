"""Preference pairs of very different lengths: what the DPO tests train on."""

from __future__ import annotations

import json
import random
from pathlib import Path

from workers.data import prepare_data

SEQ_LEN = 32  # tests.support.jobs.TINY's model.seq_len


def write_pairs(path: Path, count: int, seed: int = 0) -> Path:
    """``count`` JSONL lines {prompt, chosen, rejected} of random letters: prompts of 1 to 20, answers of none to 40
    (some cut at `SEQ_LEN`), so pairs score very different counts of tokens."""
    rng = random.Random(seed)
    letters = "abcdefghij klmnop"

    def text(low: int, high: int) -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(low, high)))

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": text(1, 20), "chosen": text(0, 40), "rejected": text(0, 40)})
                            + "\n" for _ in range(count)))
    return path


def prepare_pairs(root: Path, count: int = 64) -> Path:
    """A prepared directory of ``count`` preference pairs padded to `SEQ_LEN` (``--format preference``)."""
    write_pairs(root / "src" / "pairs.jsonl", count)
    prepare_data([root / "src"], root / "pairs", format="preference", seq_len=SEQ_LEN)
    return root / "pairs"
