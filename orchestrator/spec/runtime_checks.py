"""Checks that need the data directory, the filesystem or the cluster, run before any actor starts.

`check_before_start` runs every filesystem precondition (data prepared, intact and big enough, output paths writable
and not someone else's files, the offload directory, `model.init_from`'s weight files, a base checkpoint's
checksums) from the driver, so a job that cannot run fails in seconds with a `SpecError` instead of inside a rank
after placement. `raymesh plan` runs the same checks, except that it tolerates a data directory that is not on this
machine (planning happens anywhere).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from orchestrator.checkpoints import checksums
from orchestrator.checkpoints.directory import SCORE
from orchestrator.checkpoints.job_record import RECORD
from orchestrator.errors import SpecError
from orchestrator.spec.checks.dpo import check_dpo_data
from orchestrator.spec.checks.loss_mask import check_eval_mask, check_training_mask
from orchestrator.spec.fields import NAME_MAX
from orchestrator.spec.integrity_checks import check_init_from, check_shards_intact
from orchestrator.spec.job import JobSpec
from orchestrator.spec.lora import check_base_checkpoint
from workers.data import blend
from workers.data.checksums import FIELD as SHARD_CHECKSUM
from workers.data.manifest import manifest_problem
from workers.data.tokenizer import TOKENIZER_FILE, manifest_eos_id, tokenizer_sha256
from workers.storage import is_url, location


def check_before_start(spec: JobSpec, *, data_required: bool = True) -> None:
    """Every filesystem precondition of the job; `data_required=False` (plan) skips data that is not here."""
    check_data_path(spec, data_required)
    if spec.eval.path is not None and _checkable(spec.eval.path, data_required):
        check_eval_path(spec, data_required)
    check_outputs(spec)
    check_init_from(spec)
    check_base_checkpoint(spec)
    check_tls_files(spec)
    spec.loggers.check_installed()
    _local_tracker_dirs(spec)


def _checkable(path: str, data_required: bool) -> bool:
    """Whether the prepared data at `path` is checked: always before a run; by `plan` (`data_required=False`) only
    when it is a local directory that is here (planning happens anywhere, and a bucket is elsewhere)."""
    return data_required or (not is_url(path) and Path(path).exists())


def training_manifests(spec: JobSpec, data_required: bool = True) -> list[tuple[str, float, dict]]:
    """(path, weight, manifest) of every training directory (`data.path`, or each `data.mix` entry) that is checked
    (`_checkable`), each refused with the fix when missing or not one `prepare-data` wrote."""
    return [(path, weight, prepared_manifest(spec.data.field_of(path), path))
            for path, weight in spec.data.sources() if _checkable(path, data_required)]


MISSING, NOT_A_FILE = "is missing", "is not a file"  # what preparing the data again fixes


def _read_problem(path: Path) -> str | None:
    """Why this process cannot read the local file `path` (`MISSING`, `NOT_A_FILE`, or a permission), None when it
    can. ``os.access`` asks with the real user's rights, as the ranks on this host read, down every folder on the
    way."""
    if os.access(path, os.R_OK):
        return None if path.is_file() else NOT_A_FILE
    try:
        path.stat()
    except FileNotFoundError:
        return MISSING
    except OSError as exc:  # a folder on the way that this user may not enter
        return f"cannot be reached ({exc.strerror})"
    return "cannot be read by this user (permission denied)"


def _unreadable(field: str, value: str, path: Path, problem: str) -> SpecError:
    """The refusal of prepared data in `field` (`value`) whose file `path` this user cannot read."""
    return SpecError(field, value, f"holds {path}, which {problem}",
                     f"make the directory and its files readable by the user raymesh runs as (e.g. `chmod -R a+rX "
                     f"{value}`), or point {field} at a copy this user can read")


def prepared_manifest(field: str, value: str) -> dict:
    """The manifest.json of the prepared directory `value` (the job's `field`: `data.path`, `eval.path`), refused
    with the fix when missing or not one `prepare-data` wrote."""
    root = _url_location(field, value)
    if is_url(root):
        _reachable_bucket(field, root)
    manifest = root / "manifest.json"
    if root.is_file():  # `prepare-data --out` a file fails too, so that fix would not help
        raise SpecError(field, value, "is a file, not a prepared directory",
                        f"point {field} at the directory `raymesh prepare-data --out DIR` wrote (it holds "
                        "manifest.json and the shards)")
    problem = None if is_url(root) else _read_problem(manifest)
    if problem not in (None, MISSING, NOT_A_FILE):
        raise _unreadable(field, value, manifest, problem)
    if problem is not None or not manifest.is_file():
        raise SpecError(field, value, f"has no prepared data ({manifest} {problem or MISSING})",
                        f"run `raymesh prepare-data --out {value}`, or point {field} at a prepared directory")
    try:
        data = json.loads(manifest.read_bytes())
        # the count the checks need, the rest where present (the loader requires them: a directory prepare-data
        # wrote has them all, and stand-ins that give only a count still plan)
        problem = manifest_problem(data, ("total_tokens",))
        if problem is not None:
            raise ValueError(problem)
    except (OSError, ValueError) as exc:
        raise SpecError(field, value, f"has a manifest.json that is not readable ({exc})",
                        f"prepare the data again with `raymesh prepare-data --out {value}`") from None
    return data


def check_shards_readable(field: str, value: str, manifest: dict) -> None:
    """Every shard the manifest of `field` (`value`, a local directory) lists is there and readable: else the first
    rank to load the data fails after placement with a bare PermissionError or FileNotFoundError. A bucket's
    shards are read by the ranks with their own credentials, and are left to them."""
    root = location(value)
    if is_url(root):
        return
    for shard in manifest.get("shards", ()):
        path = root / shard["file"]
        problem = _read_problem(path)
        if problem in (MISSING, NOT_A_FILE):
            raise SpecError(field, value, f"lists shard {path} in its manifest.json, which {problem}",
                            f"prepare the data again with `raymesh prepare-data --out {value}`")
        if problem is not None:
            raise _unreadable(field, value, path, problem)
    check_shards_intact(field, value, manifest)


def check_data_path(spec: JobSpec, data_required: bool = True) -> None:
    """Every training directory is prepared, readable, in the model's vocabulary and holds its share of one batch
    of distinct windows; a mixture's directories hold one tokenizer's ids."""
    sources = training_manifests(spec, data_required)
    _check_distinct_sources(spec, sources)
    for path, _, manifest in sources[:1]:  # first: another tokenizer's vocabulary is not the model's to grow
        _check_one_tokenizer(spec, path, manifest, sources[1:])
    check_training_mask(spec, sources)
    check_dpo_data(spec, sources)
    for path, weight, manifest in sources:
        field = spec.data.field_of(path)
        check_shards_readable(field, path, manifest)
        check_data_vocab(spec, manifest, field, path)
        check_document_eos(spec, manifest, field, path)
        check_init_from_tokenizer(spec, manifest, field, path)
        if spec.data.mix:
            _check_share_of_batch(spec, path, weight, manifest["total_tokens"])
        else:
            _check_one_batch(spec, manifest["total_tokens"])


def _check_one_tokenizer(spec: JobSpec, path: str, manifest: dict, others: list[tuple[str, float, dict]]) -> None:
    """Refuse a `data.mix` source whose ids are another tokenizer's than `path`'s (its manifest `manifest`): one
    embedding row would mean two tokens."""
    for other, _, theirs in others:
        if not _same_ids(theirs, other, manifest, path):
            raise SpecError(spec.data.field_of(other), other, f"holds ids of {_made_by(theirs)} (vocab "
                            f"{theirs.get('vocab_size')}), but {spec.data.field_of(path)} {path} holds those of "
                            f"{_made_by(manifest)} (vocab {manifest.get('vocab_size')}): a mixture's sources must be "
                            "one tokenizer's ids", f"prepare {other} again with the --tokenizer {path} was prepared "
                            "with (its tokenizer.json), or drop it from data.mix")


def _check_one_batch(spec: JobSpec, tokens: int) -> None:
    """`data.path` holds one batch of distinct `seq_len + 1` token windows.

    The loader cuts the token stream into windows of seq_len + 1 tokens that share one boundary token, so one
    step's global_batch_size windows need global_batch_size * seq_len + 1 tokens; with fewer, one batch would
    repeat windows (or, with fewer than seq_len + 1 tokens, have none)."""
    seq, batch = spec.model.seq_len, spec.train.global_batch_size
    if batch * seq + 1 <= tokens:
        return
    fixes = [f"set model.seq_len to at most {(tokens - 1) // batch}"] if tokens > batch else []
    if tokens > seq:
        fixes.append(f"lower train.global_batch_size to at most {(tokens - 1) // seq}")
    fixes.append(f"prepare more data into {spec.data.path}")
    raise SpecError(
        "model.seq_len", seq,
        f"with train.global_batch_size={batch} needs {batch * seq + 1:,} tokens for one batch of distinct "
        f"windows, but data.path {spec.data.path} holds {tokens:,}",
        ", or ".join(fixes),
    )


def _check_share_of_batch(spec: JobSpec, path: str, weight: float, tokens: int) -> None:
    """A `data.mix` source holds its share of one batch in distinct windows: the blend gives it within one sample of
    share x global_batch_size of every batch, so with fewer windows a batch repeats some of them (a source smaller
    than that is better given a lower weight, or more text)."""
    paths, weights = zip(*spec.data.sources())
    share = float(blend.normalised(list(weights))[paths.index(path)])  # the blend's own shares (huge weights too)
    seq, batch = spec.model.seq_len, spec.train.global_batch_size
    windows = min(batch, math.ceil(share * batch - 1e-9) + 1)  # blind to float dust: 0.7 / 1.0 x 10 is 7
    if windows * seq + 1 <= tokens:
        return
    field = spec.data.field_of(path)
    raise SpecError(field, path, f"holds {tokens:,} tokens, but its weight {weight:g} (share {share:.3g}) draws up "
                    f"to {windows} windows of model.seq_len + 1 = {seq + 1} tokens into each train.global_batch_size="
                    f"{batch} batch, which needs {windows * seq + 1:,} tokens of distinct windows",
                    f"prepare more data into {path}, lower {field.removesuffix('.path')}.weight, or lower "
                    "model.seq_len")


def check_data_vocab(spec: JobSpec, manifest: dict, field: str, value: str) -> None:
    """Refuse a model whose vocabulary cannot hold the ids of `field` (`value`), whose manifest is `manifest` (the
    embedding lookup would fail mid-run)."""
    data_vocab = manifest.get("vocab_size")
    if data_vocab is None or spec.model.vocab_size >= data_vocab:
        return
    tp = spec.parallel.tp
    raise SpecError(
        "model.vocab_size", spec.model.vocab_size,
        f"is smaller than the vocabulary of the data in {field} {value} ({data_vocab} ids, {_made_by(manifest)})",
        f"set model.vocab_size: {data_vocab} (it is padded to {-(-data_vocab // tp) * tp}, a multiple of "
        f"parallel.tp={tp}, internally), or prepare the data with a smaller tokenizer",
    )


def check_document_eos(spec: JobSpec, manifest: dict, field: str, value: str) -> None:
    """`model.attention_mask: document` counts documents by the end-of-document id `field` (`value`) records in
    its manifest; ids written as bare rows (`write_token_rows`, a Ray dataset) record none, so the ranks could
    not tell where a document ends."""
    if spec.model.attention_mask != "document" or manifest_eos_id(manifest) is not None:
        return
    raise SpecError("model.attention_mask", "document", f"needs the end-of-document id of the data in {field} "
                    f"{value}, but its manifest records none ({_made_by(manifest)}: ids written as bare rows, with "
                    "no separator between documents)", "prepare the data with `raymesh prepare-data` (it puts the "
                    "tokenizer's end-of-document id between documents), or set model.attention_mask: causal")


def check_init_from_tokenizer(spec: JobSpec, manifest: dict, field: str, value: str) -> None:
    """When `model.init_from` ships a tokenizer.json, the data in `field` (`value`: `data.path`, a `data.mix`
    entry) must have been tokenized with it:
    otherwise a pretrained model is fine-tuned on ids that mean other tokens. Data written as bare ids
    (`write_token_rows`, kind `ids`) records no tokenizer and is taken as the user's word."""
    if spec.model.init_from is None:
        return
    model_tok = Path(spec.model.init_from) / TOKENIZER_FILE
    record = manifest.get("tokenizer") or {"kind": "bytes"}
    if not model_tok.is_file() or record.get("kind") == "ids":
        return
    problem = _tokenizer_difference(record, _data_tokenizer_sha(record, value), model_tok)
    if problem is None:
        return
    raise SpecError(field, value, f"holds ids of {_made_by(manifest)}, but model.init_from "
                    f"{spec.model.init_from} was trained with its own {TOKENIZER_FILE}: {problem}",
                    f"prepare the data with `raymesh prepare-data --tokenizer {model_tok} --out DIR` and point "
                    f"{field} at DIR")


def _tokenizer_difference(record: dict, data_sha: str | None, model_tok: Path) -> str | None:
    """How the data's tokenizer (its manifest `record`, its file's hash if known) differs from `model_tok`."""
    from tokenizers import Tokenizer

    if record.get("kind") == "bytes":
        return "the data is raw bytes"
    vocab = Tokenizer.from_file(str(model_tok)).get_vocab_size(with_added_tokens=True)
    if record.get("vocab_size") != vocab:
        return f"the data's tokenizer has {record.get('vocab_size')} ids, the checkpoint's {vocab}"
    if data_sha is not None and data_sha != tokenizer_sha256(model_tok):
        return "the two tokenizer.json files differ in content (sha256)"
    return None


def _data_tokenizer_sha(record: dict, data_path: str) -> str | None:
    """The data tokenizer's content hash: the manifest's, else (a manifest written before it recorded one) the
    hash of its tokenizer.json found beside the shards or at its recorded path; None when neither is here."""
    if record.get("sha256"):
        return record["sha256"]
    root = location(data_path)
    for candidate in (root / TOKENIZER_FILE, Path(record["path"]) if record.get("path") else None):
        if candidate is not None and candidate.is_file():
            return tokenizer_sha256(candidate)
    return None


def _made_by(manifest: dict) -> str:
    """The tokenizer a manifest records, as a message names it."""
    tok = manifest.get("tokenizer") or {"kind": "bytes"}
    return f"tokenizer {tok['kind']}" + (f" {tok['path']}" if tok.get("path") else "")


def check_eval_path(spec: JobSpec, data_required: bool = True) -> None:
    """`eval.path` is prepared with the training data's tokenizer (scoring other ids would mean nothing) and holds
    `eval.batches` batches of distinct `seq_len + 1` windows (the same ones at every evaluation)."""
    manifest = prepared_manifest("eval.path", spec.eval.path)
    check_shards_readable("eval.path", spec.eval.path, manifest)
    check_data_vocab(spec, manifest, "eval.path", spec.eval.path)
    check_document_eos(spec, manifest, "eval.path", spec.eval.path)
    check_eval_mask(spec, manifest, training_manifests(spec, data_required))
    for path, _, data in training_manifests(spec, data_required):
        if not _same_ids(manifest, spec.eval.path, data, path):
            raise SpecError("eval.path", spec.eval.path, f"holds ids of {_made_by(manifest)} (vocab "
                            f"{manifest.get('vocab_size')}), but {spec.data.field_of(path)} {path} holds those of "
                            f"{_made_by(data)} (vocab {data.get('vocab_size')})", "prepare the held-out text with "
                            "the training data's --tokenizer (`raymesh prepare-data --heldout` does), or point "
                            "eval.path at such a directory")
        _check_not_trained_on(spec, manifest, data, path)
    windows = (manifest["total_tokens"] - 1) // spec.model.seq_len
    ev, batch = spec.eval, spec.train.global_batch_size
    if ev.batches * batch <= windows:
        return
    fix = f"set eval.batches to at most {windows // batch}" if windows >= batch else \
        "lower train.global_batch_size or model.seq_len"
    raise SpecError("eval.batches", ev.batches, f"needs {ev.batches * batch:,} distinct sequences of "
                    f"model.seq_len + 1 = {spec.model.seq_len + 1} tokens (eval.batches x train.global_batch_size="
                    f"{batch}), but eval.path {ev.path} holds {windows:,}",
                    f"{fix}, or hold out more text (a larger --heldout)")


def _check_not_trained_on(spec: JobSpec, manifest: dict, data: dict, path: str) -> None:
    """Refuse an `eval.path` (its manifest `manifest`) holding a shard of the training directory `path` (its
    manifest `data`): its loss would be
    the training loss of sequences the model learns from, not a held-out one. A shard is known by its checksum
    (manifests from before checksums have none and are not compared), so a copy of the data is caught too."""
    shared = _shared_shard(manifest, data)
    if shared is not None:
        raise SpecError("eval.path", spec.eval.path, f"holds tokens the job trains on (its {shared} is a shard of "
                        f"{spec.data.field_of(path)} {path}), so its loss would not be a held-out one",
                        "point eval.path at a held-out split (`raymesh prepare-data --heldout 0.01 --out DIR` "
                        "writes DIR/heldout and keeps its documents out of DIR), or at other text prepared with "
                        "the same --tokenizer")


def _shared_shard(manifest: dict, other: dict) -> str | None:
    """The first shard file of `manifest` whose checksum is one of `other`'s shards' (the same tokens, wherever they
    live: a copy, a symlink, an object-store upload), or None. Manifests from before checksums have none, so are
    never matched."""
    theirs = {shard.get(SHARD_CHECKSUM) for shard in other["shards"]} - {None}
    return next((s["file"] for s in manifest["shards"] if s.get(SHARD_CHECKSUM) in theirs), None)


def _check_distinct_sources(spec: JobSpec, sources: list[tuple[str, float, dict]]) -> None:
    """Refuse two `data.mix` entries that are one directory written two ways (`a/../b`, a symlink) or hold the same
    tokens (a shard in common): both draw the same sample ids in the same order (one seed), so every sample would
    be trained on twice in a row, not at the weights written."""
    for i, (path, weight, manifest) in enumerate(sources):
        for other, other_weight, theirs in sources[:i]:
            same_dir = not is_url(path) and not is_url(other) and os.path.realpath(path) == os.path.realpath(other)
            shard = None if same_dir else _shared_shard(manifest, theirs)
            if same_dir or shard is not None:
                what = "is the same directory as" if same_dir else f"holds a shard ({shard}) of"
                raise SpecError(spec.data.field_of(path), path, f"{what} {spec.data.field_of(other)} {other}, so the "
                                "mixture would train on those samples twice in a row",
                                f"list it once, with the sum of the two weights ({other_weight:g} + {weight:g} = "
                                f"{other_weight + weight:g})")


def _same_ids(manifest: dict, path: str, other: dict, other_path: str) -> bool:
    """Whether two prepared directories (their manifests and paths) hold the same tokenizer's ids: the same
    vocabulary and end-of-document id and, for a tokenizer.json, the same content (sha256) where both are known.
    Its kind does not count: a BPE trained by one prepare (``bpe``) and given to the next as ``--tokenizer``
    (``file``) is one tokenizer, while two BPEs trained on different text share kind, size and eos id."""
    if _ids(manifest) != _ids(other):
        return False
    if _ids(manifest)[0] != "tokenizer.json":
        return True
    shas = [_data_tokenizer_sha(m.get("tokenizer") or {}, p) for m, p in ((manifest, path), (other, other_path))]
    return None in shas or shas[0] == shas[1]


def _ids(manifest: dict) -> tuple:
    """What two prepared directories' ids must share to be the same tokenizer's ids, wherever its file was copied:
    its family (bytes, bare ids, or a tokenizer.json: ``file`` or ``bpe``), vocabulary and end-of-document id."""
    tok = manifest.get("tokenizer") or {"kind": "bytes"}
    family = "tokenizer.json" if tok.get("kind") in ("file", "bpe") else tok.get("kind")
    return family, manifest.get("vocab_size"), tok.get("eos_id")


def _url_location(field: str, value: str) -> Path:
    """`workers.storage.location` of a path field, with a URL whose scheme no installed fsspec file system
    serves refused by name (fsspec raises ValueError, ImportError or OSError, depending on the scheme)."""
    try:
        return location(value)
    except (ValueError, ImportError, OSError) as exc:
        raise SpecError(field, value, f"is a URL whose scheme no installed file system serves ({exc})",
                        "use s3:// (pip install 'raymesh[s3]'), gs:// (pip install 'raymesh[gcs]'), file:// or a "
                        "local path") from None


def check_tls_files(spec: JobSpec) -> None:
    """The PEM files `control.tls_*` and (with shards) `parameter_server.tls_*` name are readable files here: the
    controller reads them only after Ray is up, and the shards' pair after the rank actors have started."""
    sections = ["control"] + (["parameter_server"] if spec.parallel.dp_sync == "ps" else [])
    for section in sections:
        for key in ("tls_cert", "tls_key"):
            path = getattr(getattr(spec, section), key)
            if path is not None and not (Path(path).is_file() and os.access(path, os.R_OK)):
                why = "is a directory" if Path(path).is_dir() else "is not a readable file"
                raise SpecError(f"{section}.{key}", path, f"{why} (the PEM {key.removeprefix('tls_')} TLS needs)",
                                f"point {section}.{key} at a readable PEM file where the controller runs, or remove "
                                f"{section}.tls_cert and tls_key to serve without TLS")


def _local_tracker_dirs(spec: JobSpec) -> None:
    """TensorBoard and W&B write many small appends to a local directory: a URL there is refused (their default,
    inside the run dir, goes to a URL run dir's bucket with the run's other files), and so is a file or a folder
    this process cannot write (the tracker opens it in the controller, after the actors started)."""
    for name in ("tensorboard", "wandb"):
        section = getattr(spec.loggers, name)
        if section is None or not section.dir:
            continue
        if is_url(section.dir):
            raise SpecError(f"loggers.{name}.dir", section.dir, "is a URL, and the tracker appends to local files",
                            f"remove loggers.{name}.dir so its files go in the run dir (set run_dir to the URL to "
                            "have them copied up with the run's records), or give a local path")
        check_writable_dir(f"loggers.{name}.dir", Path(section.dir))


def _reachable_bucket(field: str, path: Path) -> None:
    """The bucket of the object-store URL ``path`` exists and these credentials may list it (writing is only
    tried by the first save: a probe object would be one more thing in someone's bucket). The driver's
    credentials are checked; the ranks use their own node's (the same variables, set on every node)."""
    bucket = path.path.split("/", 1)[0]
    try:
        found = path.fs.exists(bucket)
    except Exception as exc:  # each fsspec back end raises its own (botocore, google.auth, PermissionError)
        raise SpecError(field, str(path), f"cannot be reached ({type(exc).__name__}: {exc})",
                        "check the credentials in the environment (for s3://: AWS_ACCESS_KEY_ID, "
                        "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for a non-AWS server) and the URL") from None
    if not found:
        raise SpecError(field, str(path), f"names bucket {bucket!r}, which does not exist (or these credentials "
                        "cannot see it)", "create the bucket, or fix the URL or the credentials")


def unwritable_ancestor(path: Path) -> Path | None:
    """The nearest existing of `path` and its parents when it is not a directory this process can write in (so
    `path` cannot be written or created there); None when it is."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    return None if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK) else existing


def check_writable_dir(field: str, path: Path) -> None:
    """`path` is a directory raymesh can write in, or can be created under its nearest existing parent."""
    if path.exists() and not path.is_dir():
        raise SpecError(field, str(path), "is a file, not a directory", f"point {field} at a directory")
    existing = unwritable_ancestor(path)
    if existing is not None:
        where = "it" if existing == path else f"its parent {existing}"
        raise SpecError(field, str(path), f"cannot be written: {where} is not a writable directory",
                        f"point {field} at a directory you can write, or fix its permissions")


def _raymesh_file_sd(path: Path) -> bool:
    """Whether `path` is a Prometheus target file raymesh wrote (observability.prometheus): [] or its entries."""
    try:
        entries = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("labels"), dict) and "raymesh_job" in e["labels"] for e in entries)


# what raymesh writes in a checkpoint step directory: DCP's files, its checksum manifest, the held-out score of a
# scored save (directory.SCORE), the job fields it is read by (job_record.RECORD), temp files, and the
# parameter-server shards' own DCP folder (parameter_server.checkpoint.FOLDER)
_STEP_ENTRY = re.compile(r"^step-\d{8,}(\.corrupt)?$")
_CHECKPOINT_FILE = re.compile(
    rf"^(\.metadata|__\d+_\d+\.distcp|{re.escape(checksums.MANIFEST)}|{re.escape(SCORE)}|{re.escape(RECORD)}"
    r"|.*\.tmp|ps)$")


def _foreign_checkpoint_entry(root: Path) -> Path | None:
    """A file in a `step-N` entry of the checkpoint dir that raymesh did not write (a save or prune would
    overwrite or delete it), or a `step-N` that is a file."""
    if not root.is_dir():
        return None
    for entry in sorted(root.iterdir()):
        if not _STEP_ENTRY.match(entry.name):
            continue
        if not entry.is_dir():
            return entry
        foreign = next((f for f in sorted(entry.rglob("*")) if not _CHECKPOINT_FILE.match(f.name)), None)
        if foreign is not None:
            return foreign
    return None


def check_outputs(spec: JobSpec) -> None:
    """Where the job writes: the run dir, checkpoints, the nvme offload dir and the metrics target file."""
    url = spec.run_dir_url()
    if url is not None:  # its files are staged in a local directory (below) and copied up
        _reachable_bucket("run_dir", _url_location("run_dir", url))
    run_dir = spec.resolved_run_dir()
    check_writable_dir("run_dir", run_dir)
    if spec.checkpoint.dir is not None:
        _url_location("checkpoint.dir", spec.checkpoint.dir)
    ckpt = spec.checkpoint_dir()
    if is_url(ckpt):
        _reachable_bucket("checkpoint.dir", ckpt)
    else:
        check_writable_dir("checkpoint.dir", ckpt)
    foreign = _foreign_checkpoint_entry(ckpt)
    if foreign is not None:
        raise SpecError("checkpoint.dir", str(ckpt), f"holds {foreign}, which raymesh did not write; a save or "
                        "the retention of old checkpoints would overwrite or delete it",
                        "point checkpoint.dir at a new directory, or move that file away")
    if spec.memory.offload.tier == "nvme" and spec.memory.offload.path:
        check_writable_dir("memory.offload.path", Path(spec.memory.offload.path))
    if spec.metrics.port is None:
        return
    target = spec.metrics.resolved_file_sd(run_dir)
    field = "metrics.file_sd"
    if target.is_dir() or (target.exists() and not _raymesh_file_sd(target)):
        raise SpecError(field, str(target), "is a file raymesh did not write (not a raymesh Prometheus target "
                        "list), and the job would overwrite it",
                        "point metrics.file_sd at a new file, e.g. runs/prometheus_targets/<job>.json")
    check_writable_dir(field, target.parent)
    if len(os.fsencode(target.name)) > NAME_MAX:
        raise SpecError(field, str(target), "has a file name over the OS limit NAME_MAX",
                        "set metrics.file_sd to a shorter path, or shorten the run_dir's last name")


def check_resources(spec: JobSpec, available_cpus: float, available_gpus: float, device: str) -> None:
    """Check the cluster can host dp*pp*tp ranks before any actor is created.

    Each rank takes `parallel.cpus_per_rank` CPUs, plus one GPU when `device` is
    "cuda" ("auto" means cuda when any GPU is available). ``available_cpus``/``available_gpus`` are the cluster's
    totals (``ray.cluster_resources()``): a grid they cannot hold never fits, so it is refused before any wait;
    room that is only in use is waited for by the placement (``orchestrator/runtime/placement.py``), which also
    checks each tensor-parallel group fits on one node.
    """
    p, grid = spec.parallel, spec.parallel.grid
    ranks = grid.world_size
    shape = f"{grid.describe()} = {ranks} ranks"
    use_gpu = device == "cuda" or (device == "auto" and available_gpus >= 1)
    if use_gpu and ranks > available_gpus:
        raise SpecError(
            "parallel.dp*pp*tp",
            ranks,
            f"needs {ranks} GPUs (one per rank, {shape}) but the Ray cluster has {available_gpus:g} in total",
            f"lower parallel.dp/pp/tp so dp*pp*tp <= {int(available_gpus)}, add GPU nodes to the Ray cluster, "
            "or set parallel.device: cpu",
        )
    needed = ranks * p.cpus_per_rank
    if needed > available_cpus + 1e-9:
        fit = int(available_cpus // p.cpus_per_rank)
        fixes = [f"lower parallel.dp/pp/tp so dp*pp*tp <= {fit}"] if fit >= 1 else []
        fixes += [
            f"lower parallel.cpus_per_rank to {available_cpus / ranks:g}",
            "start Ray with more CPUs (`ray start --head --num-cpus N`) or add nodes",
        ]
        raise SpecError(
            "parallel.dp*pp*tp",
            ranks,
            f"needs {needed:g} CPUs ({shape} x parallel.cpus_per_rank={p.cpus_per_rank:g}) "
            f"but the Ray cluster has {available_cpus:g} in total",
            ", or ".join(fixes),
        )
