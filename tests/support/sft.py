"""Prompt/completion data of very different lengths: what the loss-mask parity tests train on."""

from __future__ import annotations

import json
import random
from pathlib import Path

from workers.data import prepare_data


def prepare_sft(root: Path) -> tuple[Path, Path]:
    """(training data, held-out data) of ~400 prompt/completion pairs under ``root``: prompts of 1 to 40 letters,
    completions of none to 60, so microbatches and ranks hold very different counts of counted targets."""
    rng = random.Random(0)
    letters = "abcdefghij klmnop"
    lines = [json.dumps({"prompt": "".join(rng.choice(letters) for _ in range(rng.randint(1, 40))),
                         "completion": "".join(rng.choice(letters) for _ in range(rng.choice([0, 1, 3, 60])))})
             for _ in range(400)]
    (root / "src").mkdir()
    (root / "src" / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_data([root / "src"], root / "train", format="prompt-completion", heldout=0.2)
    return root / "train", root / "train" / "heldout"
