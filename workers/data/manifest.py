"""What a prepared directory's ``manifest.json`` must hold for the loader to read it, checked once, in words.

A field deleted or mistyped (by hand, by a tool, by a half-written copy) used to end in a bare ``KeyError`` or
``TypeError`` inside a rank; the driver checks it before any actor starts
(``orchestrator.spec.runtime_checks.prepared_manifest``), the loader again as it opens the data.
"""

from __future__ import annotations

from workers.data.checksums import FIELD

LOADER_NEEDS = ("total_tokens", "vocab_size", "shards")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shard_problem(i: int, shard) -> str | None:
    if isinstance(shard, dict) and isinstance(shard.get("file"), str) and _count(shard.get("tokens")) \
            and isinstance(shard.get(FIELD, ""), str):
        return None
    return f"shards[{i}] {shard!r} is not an entry of a file name, a token count and a {FIELD}"


def manifest_problem(data, needs: tuple[str, ...] = LOADER_NEEDS) -> str | None:
    """What is wrong with the manifest ``data`` (a field of ``needs`` missing, or any field the loader reads of the
    wrong kind), or None."""
    if not isinstance(data, dict):
        return "it is not a JSON object"
    missing = [key for key in needs if key not in data]
    if missing:
        return f"it has no {', '.join(missing)}"
    if "total_tokens" in data and not _count(data["total_tokens"]):
        return f"total_tokens {data['total_tokens']!r} is not a token count"
    if "vocab_size" in data and not (_count(data["vocab_size"]) and data["vocab_size"] > 0):
        return f"vocab_size {data['vocab_size']!r} is not a positive whole number"
    shards = data.get("shards", [])
    if not isinstance(shards, list):
        return f"shards {shards!r} is not a list"
    problem = next(filter(None, (_shard_problem(i, shard) for i, shard in enumerate(shards))), None)
    if problem is not None:
        return problem
    tok = data.get("tokenizer")
    if tok is not None and not (isinstance(tok, dict) and isinstance(tok.get("kind", "bytes"), str)):
        return f"tokenizer {tok!r} is not a record of a tokenizer"
    return None
