"""What a benchmark's figures depend on besides its arguments, recorded beside them in its JSON.

A loss figure depends on the corpus, and the default corpus is the standard library of whichever interpreter
prepared it: on the communication benchmark's uncompressed job, 200 steps ended at a loss of 2.44 on Python
3.13's stdlib and 2.67 on 3.9's. Timings depend on the machine and the CPU's kernel set. Two runs whose
``provenance`` differ are not expected to agree; two whose provenance is equal are.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from workers.data import checksums


def corpus(path: str | Path) -> dict:
    """The prepared corpus at ``path``: its sources, size, tokenizer and one digest over its shards' checksums
    (from the manifest, so nothing is re-read)."""
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    digest = hashlib.sha256("".join(s.get(checksums.FIELD, s["file"]) for s in manifest["shards"]).encode())
    return {"path": str(path), "sources": manifest.get("sources"), "total_tokens": manifest["total_tokens"],
            "tokenizer": manifest.get("tokenizer", {}).get("kind", "bytes"), "digest": digest.hexdigest()[:16]}


def provenance(data: str | Path | None = None) -> dict:
    """Interpreter, torch, CPU kernel set and cores, and the corpus at ``data`` when the benchmark read one."""
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count()}
    if data is not None:
        out["corpus"] = corpus(data)
    return out


def write_result(out: str | Path, result: dict | list, data: str | Path | None = None) -> None:
    """``result`` as JSON at ``out``, with the run's :func:`provenance` beside it (a list goes under ``rows``)."""
    body = result if isinstance(result, dict) else {"rows": result}
    Path(out).write_text(json.dumps({**body, "provenance": provenance(data)}, indent=2) + "\n")
