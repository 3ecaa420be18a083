"""The tokenizers ``prepare-data --tokenizer`` takes: raw bytes, a Hugging Face ``tokenizer.json``, or a BPE
trained on the corpus with Hugging Face ``tokenizers``.

Each one encodes a document (its file's bytes) to ids, names its end-of-document id (placed between
documents) and says what the manifest records about it, so a job can be checked against the data and the
ids can be turned back into text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

BYTE_VOCAB = 256
BYTE_EOS = 0  # NUL practically never occurs in text; prepare_data refuses a file that holds one
# end-of-document tokens as common tokenizer.json files name them, tried in this order
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
TRAINED_EOS = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"  # a trained tokenizer's name beside the shards


def narrowest_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type holding ids ``0 .. vocab_size - 1``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit 32 bits")


class ByteTokens:
    """Every byte is its own token (vocab 256): nothing to train or download."""

    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS
    dtype = np.dtype(np.uint8)

    def encode(self, doc: bytes) -> np.ndarray:
        return np.frombuffer(doc, dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; a byte sequence that is not UTF-8 (a character cut short) shows as U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"kind": "bytes", "path": None, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class HFTokens:
    """A Hugging Face ``tokenizers`` tokenizer: documents decoded as UTF-8 (bad bytes replaced), then encoded.

    Encoded without the tokenizer's own special tokens (a Llama ``tokenizer.json`` would prepend BOS): the
    end-of-document id between documents is the only separator, as with bytes. So a special token's text inside
    a document (a source file or page that mentions ``<|endoftext|>``) is encoded as the text it is, not as the
    special id: else it would cut its document in two with a false end-of-document.

    ``kind`` is ``file`` for a given ``tokenizer.json`` and ``bpe`` for one trained here; ``path`` is where
    the tokenizer file lives (recorded in the manifest so the ids can be decoded later).
    """

    def __init__(self, tokenizer, kind: str, path: Path):
        self.tokenizer, self.kind, self.path = tokenizer, kind, path
        tokenizer.encode_special_tokens = True  # special tokens' text in a document stays text (see above)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = _eos_id(tokenizer, path)
        self.dtype = narrowest_dtype(self.vocab_size)

    def encode(self, doc: bytes) -> np.ndarray:
        ids = self.tokenizer.encode(doc.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=self.dtype)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def describe(self) -> dict:
        """The manifest's record; ``sha256`` lets a job tell whether a model's tokenizer.json is this one
        wherever either file was copied (manifests written before it have none)."""
        return {"kind": self.kind, "path": str(self.path), "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "sha256": tokenizer_sha256(self.path)}


def tokenizer_sha256(path) -> str:
    """Hex SHA-256 of a tokenizer.json's content (a ``Path`` or an fsspec path), as canonical JSON (keys sorted,
    no spaces), so the same tokenizer re-saved with other indentation or key order hashes the same."""
    canonical = json.dumps(json.loads(path.read_bytes()), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _eos_id(tokenizer, path: Path) -> int:
    for name in EOS_NAMES:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return found
    raise ValueError(f"--tokenizer {path} has none of the end-of-document tokens {list(EOS_NAMES)}; "
                     "add one as a special token, or use --tokenizer bytes or bpe:SIZE")


def train_bpe(documents: Iterable[bytes], vocab_size: int, out: Path) -> HFTokens:
    """A byte-level BPE of ``vocab_size`` ids (``TRAINED_EOS`` included) trained on ``documents``, saved to ``out``.

    Byte-level (GPT-2 style): every byte is in the initial alphabet, so any text encodes without unknowns.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((d.decode("utf-8", errors="replace") for d in documents), trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return HFTokens(tokenizer, "bpe", out)


def bpe_size(spec: str) -> int | None:
    """The vocab size of a ``bpe:SIZE`` tokenizer argument; None when ``spec`` is not one."""
    if not spec.startswith("bpe:"):
        return None
    size = spec.removeprefix("bpe:")
    # 256 byte symbols + the end-of-document token: anything smaller cannot even hold the alphabet
    if not size.isdigit() or int(size) <= BYTE_VOCAB:
        raise ValueError(f"--tokenizer {spec!r}: SIZE must be an integer above {BYTE_VOCAB} (the byte alphabet), "
                         "e.g. bpe:4096")
    return int(size)


def load_tokenizer(spec: str):
    """``bytes`` or a ``tokenizer.json`` path as a tokenizer (``bpe:SIZE`` is trained by ``prepare_data``)."""
    if spec == "bytes":
        return ByteTokens()
    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer {spec!r} is neither 'bytes', 'bpe:SIZE' nor an existing "
                                "tokenizer.json file; pass one of those")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"--tokenizer {spec!r} is not a tokenizer file `tokenizers` can read ({exc}); fix: pass "
                         "the tokenizer.json saved with the model (not tokenizer_config.json), 'bytes' or "
                         "'bpe:SIZE'") from None
    return HFTokens(tokenizer, "file", path)


def manifest_eos_id(manifest: dict) -> int | None:
    """The end-of-document id between the documents of a prepared directory whose manifest is ``manifest``, or
    None for ids written as bare rows (``write_token_rows``: no separator). A manifest from before the
    ``tokenizer`` record holds bytes, separated by ``BYTE_EOS``."""
    return (manifest.get("tokenizer") or {"eos_id": BYTE_EOS}).get("eos_id")


def recorded_tokenizer(record: dict, root):
    """The tokenizer a manifest's ``tokenizer`` entry ``record`` names, for the prepared directory ``root`` (a
    ``Path`` or an fsspec path): bytes, or the ``tokenizer.json`` it names, looked for beside the shards first
    (a trained BPE travels with its data, wherever the directory was moved). ``ids`` rows have no tokenizer."""
    kind = record.get("kind", "bytes")
    if kind == "bytes":
        return ByteTokens()
    if kind == "ids":
        raise LookupError("the data was written as token ids (no tokenizer), so ids cannot be turned into text")
    from tokenizers import Tokenizer

    beside = root / TOKENIZER_FILE
    path = beside if beside.is_file() else Path(record.get("path") or beside)
    if not path.is_file():
        raise FileNotFoundError(f"the data's tokenizer {record.get('path')} is not there (nor {beside})")
    try:
        tok = HFTokens(Tokenizer.from_str(path.read_text()), kind, path)
        check_recorded(record, tok)
    except TokenizerMismatch:
        raise
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse; JSON a ValueError
        raise TokenizerMismatch(f"{path} is not a tokenizer file `tokenizers` can read ({exc})") from None
    return tok


class TokenizerMismatch(ValueError):
    """The tokenizer file found for a prepared directory is not the one its manifest records (its message says
    which file, and how it differs)."""


def check_recorded(record: dict, tok: HFTokens) -> None:
    """Refuse ``tok`` (read from ``tok.path``) unless it is the tokenizer the manifest's ``record`` describes: its
    content hash where the manifest has one (``tokenizer_sha256``), else its vocabulary size and end-of-document
    id. Ids decoded by another tokenizer read as fluent garbage, with no error anywhere."""
    expected = record.get("sha256")
    if expected:
        actual = tokenizer_sha256(tok.path)
        if actual != expected:
            raise TokenizerMismatch(f"{tok.path} has sha256 {actual}, but the manifest records {expected} for the "
                                    "tokenizer the data was prepared with")
        return
    for key in ("vocab_size", "eos_id"):
        if record.get(key) is not None and record[key] != getattr(tok, key):
            raise TokenizerMismatch(f"{tok.path} has {key} {getattr(tok, key)}, but the manifest records "
                                    f"{record[key]} for the tokenizer the data was prepared with")
