"""The corpora the examples name (``data/stdlib``, ``data/stdlib-bpe``, ``data/stdlib-split`` with its held-out
``heldout/``), prepared by ``raymesh run`` when missing.

The quick start is then one install-and-run command: the main job's ``data.path`` names the default corpus
(Python's standard library, tokenized here in seconds, no download), so a fresh clone need not run
``raymesh prepare-data`` first. Only those names and only a directory that does not exist yet (or is empty):
any other missing path is the user's mistake, which ``check_data_path`` reports with the fix.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from orchestrator.events import event
from orchestrator.spec import JobSpec

DEFAULT_MAX_TOKENS = 20_000_000  # `raymesh prepare-data --max-tokens`' default: the corpus stays bounded
# directory name -> the `--tokenizer` the examples prepared it with (examples/gpt_tiny_3d.yaml, bpe_pretrain.yaml,
# evaluation.yaml)
DEFAULT_CORPORA = {"stdlib": "bytes", "stdlib-bpe": "bpe:4096", "stdlib-split": "bytes"}
# directory name -> its `--heldout` share: stdlib-split keeps 1% of the documents for eval.path (`DIR/heldout`);
# the others hold none out, so their training stream (and every figure measured on it) is what it always was
HELDOUT = {"stdlib-split": 0.01}


def names_default_corpus(path: Path) -> bool:
    """Whether ``path`` is a default corpus that is not there yet (absent, or an empty directory)."""
    if path.name not in DEFAULT_CORPORA:
        return False
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def prepare_default_corpus(spec: JobSpec) -> bool:
    """Prepare each training directory (``data.path``, or a ``data.mix`` entry) that names a missing default corpus
    from the default sources; True if it prepared any."""
    missing = [path for path, _ in spec.data.sources() if names_default_corpus(Path(path))]
    for path in missing:
        _prepare(Path(path), spec.data.field_of(path))
    return bool(missing)


def _prepare(path: Path, field: str) -> None:
    """The default corpus ``path`` (its name says which tokenizer), prepared with events saying why and how big."""
    from workers.data.prepare import default_sources, prepare_data

    tokenizer = DEFAULT_CORPORA[path.name]
    event("prepare_data", path=path, source=default_sources()[0], tokenizer=tokenizer,
          reason=f"{field} names the default corpus and is missing")
    t0 = time.perf_counter()
    manifest = prepare_data(default_sources(), path, max_tokens=DEFAULT_MAX_TOKENS, tokenizer=tokenizer,
                            heldout=HELDOUT.get(path.name, 0.0))
    held = {"heldout_tokens": manifest["heldout"]["tokens"]} if "heldout" in manifest else {}
    event("data_ready", path=path, tokens=manifest["total_tokens"], shards=len(manifest["shards"]), **held,
          seconds=f"{time.perf_counter() - t0:.1f}")
    sys.stderr.flush()
