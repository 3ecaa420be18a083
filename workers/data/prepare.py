"""Turn source trees into token shards plus a manifest that records the tokenizer.

By default bytes are the tokens (vocab 256), so nothing has to be trained or
downloaded; ``tokenizer`` also takes a Hugging Face ``tokenizer.json`` or
``bpe:SIZE`` (``workers.data.tokenizer``). The default corpus is the running
interpreter's standard library, present everywhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from workers import orphans
from workers.data import checksums
from workers.data.tokenizer import TOKENIZER_FILE, ByteTokens, bpe_size, load_tokenizer, train_bpe

FORMAT = "raymesh-bytes-v1"  # kept for every tokenizer: ids carry their type in Parquet, the manifest says the rest
# The loader decodes one row group per window it reads: 16 Ki rows decode in well under a millisecond (1 Mi took
# ~25 ms), and a corpus of 1e9 tokens still has only 61 Ki groups to index.
ROW_GROUP_ROWS = 16_384
DEFAULT_EXTENSIONS = (".py", ".txt", ".md", ".rst")
# --format: `text` (every file a document, every token a target) or `prompt-completion` (JSONL lines of TRL's
# prompt-completion form; only completion tokens are targets, flagged in the shards' LOSS_MASK column)
# or `preference` (JSONL lines of TRL's plain-text preference form: each pair two padded sequences, chosen then
# rejected, their completion tokens flagged; `workers.model.dpo`)
FORMATS = {"text": DEFAULT_EXTENSIONS, "prompt-completion": (".jsonl",), "preference": (".jsonl",)}
PREFERENCE = "preference"  # the manifest's key for such data: {"seq_len": the length every sequence is padded to}
LOSS_MASK = "loss_mask"  # the shards' column (uint8, 1: a completion token, whose prediction counts) and manifest key
STAGING_PREFIX = ".prepare-"  # the hidden folder inside --out a prepare writes into before swapping it in
HELDOUT_DIR = "heldout"  # `--heldout`'s documents, a prepared directory of their own inside the training one
# Third-party installs nested in a tree (e.g. the stdlib's site-packages) would make the
# corpus depend on what happens to be installed; a source that *is* such a dir still works.
PRUNED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
log = logging.getLogger(__name__)


def default_sources() -> list[Path]:
    """The stdlib source dir: a sizeable text corpus that needs no download."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def prepare_small_corpus(prefix: str) -> Path:
    """A fresh temporary directory of shards from the stdlib's ``json`` package: a benchmark's default data,
    tokenized in well under a second, so a benchmark runs without ``--data``."""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix=prefix))
    prepare_data([default_sources()[0] / "json"], out)
    return out


class Unreadable:
    """The source files and folders a prepare could not read (permissions, a broken link, an I/O error).

    Why: one such path should not end a prepare of a large tree, but leaving it out without a word has the user
    train on less data than they think; so each is counted once (the sources are walked once per pass) and the
    manifest and the command say how many, naming the first `SHOWN`."""

    SHOWN = 3

    def __init__(self) -> None:
        self.files: dict[str, str] = {}  # path -> why, in walk order
        self.folders: dict[str, str] = {}

    def file(self, path: Path, err: OSError) -> None:
        self.files.setdefault(str(path), err.strerror or str(err))

    def folder(self, err: OSError) -> None:
        """``os.walk``'s ``onerror``: a folder it could not list, whose files it would otherwise pass over."""
        self.folders.setdefault(str(err.filename), err.strerror or str(err))

    def record(self) -> dict:
        """What the manifest keeps (``unreadable``): the counts, and the first paths with why."""
        first = [f"{path} ({why})" for path, why in [*self.folders.items(), *self.files.items()][:self.SHOWN]]
        return {"files": len(self.files), "folders": len(self.folders), "first": first}

    def __bool__(self) -> bool:
        return bool(self.files or self.folders)


def unreadable_message(record: dict) -> str:
    """One line on the sources left out as unreadable (``Unreadable.record``), with the fix."""
    more = record["files"] + record["folders"] - len(record["first"])
    return (f"{record['files']} source file(s) and {record['folders']} folder(s) could not be read and are not in "
            f"the data: {', '.join(record['first'])}{f' and {more} more' if more else ''}; fix: make them readable "
            "by this user (e.g. `chmod -R a+rX SOURCE`) and prepare again, or leave them out of --source")


def _iter_files(source: Path, extensions: tuple[str, ...], unreadable: Unreadable) -> Iterator[Path]:
    """Matching files under `source` in sorted order; an explicitly named file is always included. A folder that
    cannot be listed is noted in `unreadable`."""
    if source.is_file():
        yield source
        return
    for root, dirs, files in os.walk(source, onerror=unreadable.folder):  # does not follow dir symlinks: no cycles
        dirs[:] = sorted(d for d in dirs if d not in PRUNED_DIRS)
        for name in sorted(files):
            if name.endswith(extensions):
                yield Path(root, name)


def _iter_documents(sources: Iterable[Path], extensions: tuple[str, ...], unreadable: Unreadable,
                    eos_byte: int | None = None) -> Iterator[bytes]:
    """Each matching file's bytes once (``_iter_sources``), a file holding ``eos_byte`` (the bytes tokenizer's
    end-of-document id) refused (``_check_no_eos_byte``)."""
    for path, data in _iter_sources(sources, extensions, unreadable):
        if eos_byte is not None:
            _check_no_eos_byte(path, data, eos_byte)
        yield data


def _iter_sources(sources: Iterable[Path], extensions: tuple[str, ...],
                  unreadable: Unreadable) -> Iterator[tuple[Path, bytes]]:
    """(path, bytes) of each matching, non-empty file once, even when sources overlap (a directory and one inside
    it, a file named again): else a document could be trained on twice, or land in training and in the held-out
    split. A file that cannot be read is left out and noted in `unreadable`."""
    seen: set[Path] = set()
    for source in sources:
        for path in _iter_files(source, extensions, unreadable):
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            try:
                data = path.read_bytes()
            except OSError as err:
                unreadable.file(path, err)
                continue
            if data:
                yield path, data


class Example(NamedTuple):
    """One prompt-completion pair (UTF-8 text): prompt tokens are read, completion tokens are also targets."""

    prompt: bytes
    completion: bytes


class Pair(NamedTuple):
    """One preference pair (UTF-8 text) and the ``file:line`` it came from (what a refusal of it names)."""

    prompt: bytes
    chosen: bytes
    rejected: bytes
    where: str


class Encoded(NamedTuple):
    """Ids and loss-mask flags already laid out (a pair's two padded sequences): written as they are, with no
    end-of-document id put before them (`_pieces`)."""

    ids: np.ndarray
    flags: np.ndarray


def _iter_examples(sources: Iterable[Path], extensions: tuple[str, ...], unreadable: Unreadable,
                   eos_byte: int | None = None) -> Iterator[Example]:
    """Each JSONL line ``{"prompt": str, "completion": str}`` of the matching files, in order; blank lines are
    skipped, anything else is refused naming ``file:line`` (a bad line dropped would shrink the data unseen)."""
    for where, line in _jsonl_lines(sources, extensions, unreadable):
        yield Example(*_example(where, line, eos_byte, Example._fields))


def _iter_pairs(sources: Iterable[Path], extensions: tuple[str, ...], unreadable: Unreadable,
                eos_byte: int | None = None) -> Iterator[Pair]:
    """Each JSONL line ``{"prompt": str, "chosen": str, "rejected": str}`` (TRL's plain-text preference form), as
    `_iter_examples` reads its pairs; an empty prompt is refused too: a sequence's first token must not be a
    target, since the window before it predicts it (``workers.data.loader.TokenDataset``)."""
    for where, line in _jsonl_lines(sources, extensions, unreadable):
        prompt, chosen, rejected = _example(where, line, eos_byte, ("prompt", "chosen", "rejected"))
        if not prompt:
            raise ValueError(f"{where} has an empty 'prompt'; fix: give every pair the prompt its answers reply to")
        yield Pair(prompt, chosen, rejected, where)


def _jsonl_lines(sources: Iterable[Path], extensions: tuple[str, ...],
                 unreadable: Unreadable) -> Iterator[tuple[str, bytes]]:
    """(``file:line``, line) of every non-blank line of the matching files, in order."""
    for path, data in _iter_sources(sources, extensions, unreadable):
        for number, line in enumerate(data.splitlines(), 1):
            if line.strip():
                yield f"{path}:{number}", line


def _example(where: str, line: bytes, eos_byte: int | None, keys: tuple[str, ...]) -> list[bytes]:
    """The UTF-8 values of ``keys`` in one JSONL ``line`` (at ``where``, file:line), or a ValueError naming it, the
    field and the fix."""
    fix = ("fix: make every line one JSON object {" + ", ".join(f'"{key}": "..."' for key in keys)
           + "} with string values")
    try:
        record = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{where} is not JSON ({err}); {fix}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} holds a JSON {type(record).__name__}, not an object; {fix}")
    fields = []
    for key in keys:
        if not isinstance(record.get(key), str):
            why = f"has no {key!r}" if key not in record else f"has {json.dumps(record[key])[:40]} as its {key!r}"
            raise ValueError(f"{where} {why}, not a string; {fix}")
        fields.append(record[key].encode("utf-8", errors="surrogatepass"))
    if eos_byte is not None:
        _check_no_eos_byte(where, b"".join(fields), eos_byte)
    return fields


def _check_no_eos_byte(path: Path | str, data: bytes, eos_byte: int) -> None:
    """Refuse a document holding the byte the bytes tokenizer separates documents with: the model would read it
    as an end of document, silently cutting the file in two. Refused rather than changed (the end-of-document
    id stays 0 in a vocabulary of 256, which every prepared directory and checkpoint was made with)."""
    at = data.find(bytes([eos_byte]))
    if at >= 0:
        raise ValueError(f"{path} holds byte {eos_byte:#04x} at offset {at}, the end-of-document id of --tokenizer "
                         "bytes, so it would be cut into two documents there; fix: remove that byte from the file "
                         "(it may not be text) or move the file out of --source, or prepare with --tokenizer "
                         "bpe:SIZE or a tokenizer.json, whose end-of-document id is a special token")


def _write_shard(out: Path, index: int, tokens: np.ndarray, flags: np.ndarray | None) -> dict:
    """One Parquet shard: the ``tokens`` column, and the `LOSS_MASK` column beside it when ``flags`` are given."""
    name = f"shard-{index:05d}.parquet"
    columns = {"tokens": pa.array(tokens)} | ({} if flags is None else {LOSS_MASK: pa.array(flags)})
    pq.write_table(pa.table(columns), out / name, row_group_size=ROW_GROUP_ROWS)
    return {"file": name, "tokens": len(tokens), checksums.FIELD: checksums.file_digest(out / name)}


def _encode(tok, item) -> tuple[np.ndarray, np.ndarray | None]:
    """(ids, loss-mask flags or None) of one document (bytes, or a row of ids) or `Example`: prompt then
    completion, each encoded alone (so the boundary is the one the user wrote, whatever the tokenizer merges)."""
    if isinstance(item, Encoded):
        return item.ids, item.flags
    if not isinstance(item, Example):
        return tok.encode(item), None
    prompt, completion = tok.encode(item.prompt), tok.encode(item.completion)
    flags = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(completion), np.uint8)])
    return np.concatenate([prompt, completion]).astype(tok.dtype, copy=False), flags


def _pair_rows(tok, pairs: Iterable[Pair], seq_len: int, limit: float) -> Iterator[Encoded]:
    """Each pair as its two sequences (`_sequence`: chosen, then rejected) in one `Encoded` piece, so a split or a
    shard cut never parts them, while the pairs' tokens stay within ``limit``; then one padding token, which
    the last sequence's window reads as its final target (never counted). Sequences cut short are counted and
    logged: their completions are scored on what is left."""
    total, cut, pad = 0, 0, _pad_id(tok)
    for pair in pairs:
        if total + 2 * seq_len + 1 > limit:
            break
        sides = [_sequence(tok, pair, side, seq_len) for side in ("chosen", "rejected")]
        cut += sum(long for _, _, long in sides)
        total += 2 * seq_len
        yield Encoded(np.concatenate([ids for ids, _, _ in sides]), np.concatenate([f for _, f, _ in sides]))
    if cut:
        log.warning("%d sequence(s) longer than --seq-len %d were cut to it (their completions' ends are not "
                    "scored); raise --seq-len (and model.seq_len) to keep them whole", cut, seq_len)
    if total:
        yield Encoded(np.array([pad], dtype=tok.dtype), np.zeros(1, np.uint8))


def _pad_id(tok) -> int:
    """The id that pads a sequence (never a target): the end-of-document id, else 0."""
    return tok.eos_id if tok.eos_id is not None else 0


def _sequence(tok, pair: Pair, side: str, seq_len: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, flags, whether it was cut) of ``pair``'s prompt and its ``side`` completion (`_encode`, as a
    prompt-completion example), the end-of-document id after it as a target (the model learns to stop, as the
    separator ends a prompt-completion example), cut or padded to ``seq_len``. A prompt that leaves no completion
    token within ``seq_len`` is refused naming the line: the pair would score nothing."""
    ids, flags = _encode(tok, Example(pair.prompt, getattr(pair, side)))
    if tok.eos_id is not None:
        ids, flags = np.append(ids, np.array(tok.eos_id, dtype=ids.dtype)), np.append(flags, np.uint8(1))
    if not flags[:seq_len].any():
        raise ValueError(f"{pair.where}'s 'prompt' is {len(ids) - int(flags.sum())} tokens, leaving none of its "
                         f"{side!r} answer within --seq-len {seq_len}; fix: raise --seq-len (and model.seq_len), "
                         "or shorten the prompt")
    pad = seq_len - len(ids)
    if pad < 0:
        return ids[:seq_len], flags[:seq_len], True
    return (np.concatenate([ids, np.full(pad, _pad_id(tok), dtype=ids.dtype)]),
            np.concatenate([flags, np.zeros(pad, np.uint8)]), False)


def _pieces(tok, documents: Iterable, limit: float) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Each document's (ids, flags), ``tok.eos_id`` before every one but the first, cut to ``limit`` tokens in all.
    The separator ends the previous example's completion, so it is flagged a target: the model learns to stop."""
    total = 0
    for doc in documents:
        ids, flags = _encode(tok, doc)
        if total and tok.eos_id is not None and not isinstance(doc, Encoded):
            ids = np.concatenate([np.array([tok.eos_id], dtype=tok.dtype), ids])
            flags = None if flags is None else np.concatenate([np.ones(1, np.uint8), flags])
        keep = int(min(len(ids), limit - total))
        total += keep
        yield ids[:keep], None if flags is None else flags[:keep]
        if total >= limit:
            return


def _write_shards(tok, documents: Iterable, out: Path, shard_tokens: int, limit: float) -> tuple[list, int]:
    """Encode ``documents`` (``_pieces``) into shards of ``shard_tokens``; stop at ``limit``."""
    shards: list[dict] = []
    pending: list[tuple[np.ndarray, np.ndarray | None]] = []
    held = total = 0
    for piece in _pieces(tok, documents, limit):
        pending.append(piece)
        held, total = held + len(piece[0]), total + len(piece[0])
        if held >= shard_tokens:
            ids, flags = _joined(pending)
            while len(ids) >= shard_tokens:
                shards.append(_write_shard(out, len(shards), ids[:shard_tokens], _head(flags, shard_tokens)))
                ids, flags = ids[shard_tokens:], None if flags is None else flags[shard_tokens:]
            pending, held = [(ids, flags)], len(ids)
    if held:
        shards.append(_write_shard(out, len(shards), *_joined(pending)))
    return shards, total


def _joined(pieces: list[tuple[np.ndarray, np.ndarray | None]]) -> tuple[np.ndarray, np.ndarray | None]:
    """The pieces' ids, and their flags (None for documents without)."""
    flags = [f for _, f in pieces]
    return np.concatenate([i for i, _ in pieces]), None if flags[0] is None else np.concatenate(flags)


def _head(flags: np.ndarray | None, n: int) -> np.ndarray | None:
    return None if flags is None else flags[:n]


def _tokenizer(spec: str, documents: Iterator[bytes], out: Path):
    """The ``--tokenizer`` named by ``spec``; ``bpe:SIZE`` is trained on ``documents`` and saved beside the shards."""
    size = bpe_size(spec)
    if size is None:
        return load_tokenizer(spec)
    return train_bpe(documents, size, out / TOKENIZER_FILE)


def is_heldout(index: int, fraction: float) -> bool:
    """Whether document ``index`` (0-based, in the sources' sorted walk) is held out of training: those where
    ``index · fraction`` crosses a whole number, so of the first n documents ⌊n · fraction⌋ are held out,
    spread evenly through the sources instead of taken from one end (which would hold out whole packages)."""
    return fraction > 0 and math.floor((index + 1) * fraction) > math.floor(index * fraction)


def _one_side(documents: Iterable, fraction: float, heldout: bool, passed: list[int] | None = None,
              upto: int | None = None) -> Iterator:
    """The training (``heldout`` False) or held-out documents of ``documents``. ``passed[0]`` is kept at the
    count of documents walked so far (the training pass records where its token limit stopped it); ``upto``
    ends the walk there (the held-out pass takes only documents the training pass reached)."""
    for index, doc in enumerate(documents):
        if upto is not None and index >= upto:
            return
        if passed is not None:
            passed[0] = index + 1
        if is_heldout(index, fraction) == heldout:
            yield doc


def prepare_data(
    sources: list[str | Path],
    out: str | Path,
    shard_tokens: int = 4_000_000,
    extensions: Iterable[str] | None = None,
    max_tokens: int | None = None,
    tokenizer: str = "bytes",
    heldout: float = 0.0,
    format: str = "text",
    seq_len: int | None = None,
) -> dict:
    """Tokenize matching files (the tokenizer's end-of-document id between them) into Parquet shards under
    `out`; return the manifest.

    `tokenizer` is ``bytes``, a ``tokenizer.json`` path, or ``bpe:SIZE`` (trained on the same documents, at
    most `max_tokens` bytes of them, and saved as `out`/tokenizer.json). Ids are stored in the narrowest
    unsigned type that holds the vocabulary. Stops after `max_tokens` tokens (separators included) so the
    default corpus stays bounded.

    `heldout` (a fraction below 1) keeps that share of the documents out of training (``is_heldout``: spread
    evenly, never split) and writes them, with the same tokenizer, as a prepared directory of their own,
    `out`/heldout, for ``eval.path``; `max_tokens` bounds the training tokens, and the held-out documents are
    those among the documents walked until then. A BPE is trained on the training documents only.

    `format` ``prompt-completion`` reads JSONL files (`extensions` default ``.jsonl``) of ``{"prompt": str,
    "completion": str}`` lines (``_iter_examples``), each one a document of its prompt's then its completion's
    ids; the shards carry a `LOSS_MASK` column flagging the completion tokens (and the separator that ends each
    completion), the manifest ``loss_mask: true``, and the loader makes only those tokens targets.

    `format` ``preference`` reads JSONL ``{"prompt", "chosen", "rejected"}`` lines (``_iter_pairs``), each pair
    written as two consecutive sequences of `seq_len` tokens, chosen then rejected (``_pair_rows``: padded, or cut),
    with the completions' tokens flagged as ``prompt-completion`` flags them; the manifest also says
    ``preference: {seq_len}``, and a job trains on it with ``train.objective: dpo`` at that ``model.seq_len``.
    """
    if format not in FORMATS:
        raise ValueError(f"--format {format!r} is not one of {', '.join(FORMATS)}; fix: pass text (every token a "
                         "target), prompt-completion (JSONL prompt/completion pairs, completions scored) or "
                         "preference (JSONL prompt/chosen/rejected lines, for train.objective: dpo)")
    if (format == "preference") != (seq_len is not None):
        raise ValueError(f"--seq-len {seq_len} with --format {format}: every preference sequence is padded to the "
                         "job's model.seq_len, and only those; fix: pass --seq-len N (the job's model.seq_len) "
                         "with --format preference, and leave it out otherwise")
    if seq_len is not None and seq_len <= 1:
        raise ValueError(f"--seq-len {seq_len} is too short for a prompt and an answer; fix: pass the job's "
                         "model.seq_len (at least 2)")
    if shard_tokens <= 0:
        raise ValueError(f"--shard-tokens {shard_tokens} is not a positive token count; fix: give a positive number, "
                         "or leave the option out for its default")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"--max-tokens {max_tokens} is not a positive token count; fix: give a positive number, "
                         "or leave the option out for its default")
    if not 0 <= heldout < 1:
        raise ValueError(f"heldout must be a fraction in [0, 1), got {heldout}; fix: e.g. --heldout 0.01 keeps one "
                         "document in a hundred out of training")
    paths = [Path(s).expanduser().resolve() for s in sources]
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(
                f"data source {p} does not exist; pass an existing directory to --source"
            )
    exts = tuple(FORMATS[format] if extensions is None else extensions)
    out = Path(out)
    with _made_for(out):
        if heldout:
            _check_heldout_free(out)
        with _staged(out, drop_heldout=True) as staging:
            return _prepare_into(staging, out, paths, exts, max_tokens, shard_tokens, tokenizer, heldout, format,
                                 seq_len)


READERS = {"text": _iter_documents, "prompt-completion": _iter_examples, "preference": _iter_pairs}


def _prepare_into(staging: Path, out: Path, paths: list[Path], exts: tuple[str, ...], max_tokens: int | None,
                  shard_tokens: int, tokenizer: str, heldout: float, format: str, seq_len: int | None) -> dict:
    """Everything ``prepare_data`` writes, written into ``staging`` (a BPE's tokenizer.json too, recorded at the
    path it will have in ``out``); returns the manifest, also written there."""
    limit = max_tokens if max_tokens is not None else float("inf")
    unreadable = Unreadable()

    def documents(side: bool = False, passed: list[int] | None = None, upto: int | None = None,
                  eos_byte: int | None = None) -> Iterator:
        return _one_side(READERS[format](paths, exts, unreadable, eos_byte), heldout, side, passed, upto)

    tok = _tokenizer(tokenizer, _bounded(map(_text, documents()), limit), staging)
    eos_byte = tok.eos_id if isinstance(tok, ByteTokens) else None

    def laid_out(items: Iterator, bound: float) -> Iterator:
        """The items as `_write_shards` takes them: preference pairs as their padded sequences."""
        return _pair_rows(tok, items, seq_len, bound) if format == "preference" else items

    walked = [0]
    shards, total = _write_shards(tok, laid_out(documents(passed=walked, eos_byte=eos_byte), limit), staging,
                                  shard_tokens, limit)
    if total == 0:
        because = f"; {unreadable_message(unreadable.record())}" if unreadable else ""
        raise ValueError(
            f"no tokens found in sources {[str(p) for p in paths]} with extensions {list(exts)}{because}"
        )
    described = tok.describe()
    if described.get("path") and Path(described["path"]).parent == staging:  # a BPE trained here: out's copy
        described["path"] = str(out / Path(described["path"]).name)
    manifest = {
        "format": FORMAT,
        "vocab_size": tok.vocab_size,
        "shards": shards,
        "total_tokens": total,
        "sources": [str(p) for p in paths],
        "dtype": tok.dtype.name,
        "tokenizer": described,
    }
    if format != "text":
        manifest[LOSS_MASK] = True
    if format == "preference":
        manifest[PREFERENCE] = {"seq_len": seq_len}
    if unreadable:
        manifest["unreadable"] = unreadable.record()
    if heldout:
        held = _write_heldout(tok, laid_out(documents(True, upto=walked[0], eos_byte=eos_byte), float("inf")),
                              staging, shard_tokens, manifest, heldout, walked[0])
        manifest["heldout"] = {"path": HELDOUT_DIR, "fraction": heldout, "tokens": held["total_tokens"]}
    return _write_manifest(staging, manifest)


@contextlib.contextmanager
def _made_for(out: Path) -> Iterator[None]:
    """``out`` and its missing parents, made for the block and removed again when it fails or is interrupted
    (Ctrl-C): a failed first prepare leaves no empty folder that passes for a dataset's place. Only folders made
    here, and only while empty (``_staged`` has removed its staging by then): never one the user had."""
    made = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):  # not empty (someone wrote there meanwhile): kept
                folder.rmdir()
        raise


@contextlib.contextmanager
def _staged(out: Path, drop_heldout: bool) -> Iterator[Path]:
    """A staging folder inside ``out`` for everything a prepare writes, swapped in (``_swap_in``) when the block
    ends without an error and removed either way: nothing in ``out`` is touched until the new data is complete,
    so a failed or interrupted prepare leaves the earlier dataset whole. A prepare killed hard (SIGKILL, SIGTERM)
    runs no clean-up, so the staging folders such a prepare left in ``out`` are removed first (``workers.orphans``:
    named with their maker's pid and host, removed only once it is gone)."""
    for stale in orphans.remove_orphans(out, STAGING_PREFIX):
        log.info("removed %s, left by a prepare that was killed", stale)
    staging = Path(tempfile.mkdtemp(prefix=orphans.owned_prefix(STAGING_PREFIX), dir=out))
    try:
        yield staging
        _swap_in(staging, out, drop_heldout)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(staging: Path, out: Path, drop_heldout: bool) -> None:
    """Replace what an earlier prepare wrote in ``out`` (its shards, which a smaller run must not leave as
    orphans, and with ``drop_heldout`` its held-out split) by ``staging``'s, the manifest last."""
    for stale in out.glob("shard-*.parquet"):
        stale.unlink()
    if drop_heldout:
        _remove_heldout(out)
    for item in sorted(staging.iterdir()):
        if item.name != "manifest.json":
            item.replace(out / item.name)
    (staging / "manifest.json").replace(out / "manifest.json")


def _check_heldout_free(out: Path) -> None:
    """``out``/heldout must be free, or a split an earlier prepare wrote (replaced): never a folder of the user's."""
    root = out / HELDOUT_DIR
    if root.exists() and not _written_here(root):
        raise FileExistsError(f"{root} exists and is not a held-out split prepare-data wrote; fix: move it away, "
                              "or pass another --out")


def _write_heldout(tok, documents: Iterator, out: Path, shard_tokens: int, parent: dict, fraction: float,
                   walked: int) -> dict:
    """`out`/heldout: the held-out documents as shards and a manifest like the training directory's."""
    root = out / HELDOUT_DIR
    root.mkdir()
    shards, total = _write_shards(tok, documents, root, shard_tokens, float("inf"))
    if total == 0:
        shutil.rmtree(root)
        fix = f"raise --heldout to at least {1 / walked:.3g}, or add sources" if walked > 1 else \
            "add sources: one document cannot be split into training and held-out ones"
        raise ValueError(f"--heldout {fraction} of the {walked} documents prepared holds out none; fix: {fix}")
    return _write_manifest(root, {**parent, "shards": shards, "total_tokens": total, "heldout_of": ".."})


def _remove_heldout(out: Path) -> None:
    """An earlier prepare's held-out directory (one this module wrote: its manifest says ``heldout_of``), which
    would no longer match the new training shards."""
    if _written_here(out / HELDOUT_DIR):
        shutil.rmtree(out / HELDOUT_DIR)


def _written_here(root: Path) -> bool:
    """Whether ``root`` is a held-out split this module wrote (its manifest says ``heldout_of``)."""
    try:
        return "heldout_of" in json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return False


def _write_manifest(out: Path, manifest: dict) -> dict:
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(out / "manifest.json")  # atomic: readers never see a half-written manifest
    return manifest


class _Ids:
    """The tokenizer face `_write_shards` needs, for rows that are ids already: no separator between rows."""

    eos_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.dtype = np.dtype(next(t for t in (np.uint8, np.uint16, np.uint32) if vocab_size <= np.iinfo(t).max + 1))

    def encode(self, row: np.ndarray) -> np.ndarray:
        row = np.asarray(row)
        if row.size and (row.min() < 0 or row.max() >= self.vocab_size):
            raise ValueError(f"token id {row.max() if row.max() >= self.vocab_size else row.min()} is outside "
                             f"[0, vocab_size={self.vocab_size}); fix: pass the vocab_size the ids were made with")
        return row.astype(self.dtype)


def write_token_rows(rows: Iterable[np.ndarray], out: str | Path, vocab_size: int, source: str,
                     shard_tokens: int = 4_000_000) -> dict:
    """Shards + manifest, as `prepare_data` writes them, from rows of token ids taken in order as one stream
    (e.g. the rows of a ``ray.data.Dataset``, already tokenized): rows are concatenated as they are, so a row
    that ends a document carries its own end-of-document id. Rows are consumed one at a time."""
    out = Path(out)
    ids = _Ids(vocab_size)
    with _made_for(out), _staged(out, drop_heldout=False) as staging:  # an id out of range, or no rows: out as it was
        shards, total = _write_shards(ids, rows, staging, shard_tokens, float("inf"))
        if total == 0:
            raise ValueError(f"no tokens in the rows of {source}")
        manifest = _write_manifest(staging, {
            "format": FORMAT, "vocab_size": vocab_size, "shards": shards, "total_tokens": total,
            "sources": [source], "dtype": ids.dtype.name, "tokenizer": {"kind": "ids", "vocab_size": vocab_size},
        })
    return manifest


def _text(document: bytes | Example | Pair) -> bytes:
    """What a BPE is trained on of a document: its bytes, an example's prompt and completion, a pair's prompt and
    both answers."""
    if isinstance(document, Pair):
        return document.prompt + document.chosen + document.rejected
    return document.prompt + document.completion if isinstance(document, Example) else document


def _bounded(documents: Iterator[bytes], limit: float) -> Iterator[bytes]:
    """``documents`` until ``limit`` bytes have passed: what a tokenizer is trained on."""
    seen = 0
    for doc in documents:
        if seen >= limit:
            return
        seen += len(doc)
        yield doc
