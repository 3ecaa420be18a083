"""Seeded mishaps to what a job reads: prepared data, the raw token cache, checkpoints, Hugging Face directories and
tokenizers, each damaged the way disks, copies and people damage them (files cut short, bytes flipped, fields
deleted or of the wrong type, tensors of another dtype or shape, a tokenizer swapped, a pickle planted).

Each mishap runs through what raymesh opens it with, Ray-free: `raymesh plan` (the pre-start checks), the data
loader, `raymesh generate` and `raymesh export-hf` (the checkpoint and tokenizer checks), the init_from read. It
must end one way: refused with a message naming the damaged thing (`names`), or, for the raw token cache, built
again with a warning naming it, or, for a manifest without checksums, accepted with a warning naming it. A
traceback is a bug; so is a known-bad mishap accepted without a word, and a planted pickle that ran.
`python -m tests.support.mishaps DIR` prints the counts.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
import shutil
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tests.support.damaged import payload, reseal, sealed_checkpoint, tiny_job

BUGS = ("traceback", "accepted", "unnamed", "ran code", "not rebuilt")
LLAMA = "  arch: llama\n  seq_len: 16\n  d_model: 32\n  n_layers: 1\n  n_heads: 2\n  vocab_size: 320\n"
Q = "model.layers.1.self_attn.q_proj.weight"
TOOLS = ("generate", "export-hf")  # what reads a checkpoint, in turn by round


@dataclass
class Mishap:
    """One damage done to a fresh copy of the pristine inputs (``damage(root, rng)``), how it is opened
    (``through``), what the answer must name, and what it must be (``refuse``, ``rebuild`` or ``warn``)."""

    area: str
    name: str
    damage: Callable[[Path], None]
    through: str
    names: tuple[str, ...]
    expect: str = "refuse"


@dataclass
class Outcome:
    mishap: Mishap
    verdict: str
    detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def pristine(root: Path) -> Path:
    """The inputs every mishap starts from, built once: bytes data and a Llama job that starts from a Hugging Face
    directory (``hf``), and BPE data with a Llama job and a sealed checkpoint (``gen``)."""
    from tests.support.hf import save_hf_llama

    tiny_job(root / "hf")
    save_hf_llama(root / "hf" / "model")
    (root / "hf" / "job.yaml").write_text("data:\n  path: DATA\nmodel:\n  init_from: MODEL\n  seq_len: 16\n"
                                          "train:\n  global_batch_size: 2\n  microbatches: 1\nrun_dir: RUN\n")
    job = tiny_job(root / "gen", model=LLAMA, tokenizer="bpe:300")
    sealed_checkpoint(job)
    return root


def workspace(pristine_root: Path, case: Path) -> Path:
    """A copy of the pristine inputs at ``case``, its job files pointing into the copy."""
    shutil.copytree(pristine_root, case)
    for manifest in case.glob("*/data/manifest.json"):  # a trained tokenizer's recorded path
        manifest.write_text(manifest.read_text().replace(str(pristine_root), str(case)))
    for job in case.glob("*/job.yaml"):
        text = job.read_text().replace(str(pristine_root), str(case))
        here = job.parent
        text = text.replace("DATA", str(here / "data")).replace("MODEL", str(here / "model"))
        job.write_text(text.replace("RUN", str(here / "run")))
    return case


# -- damage ---------------------------------------------------------------------------------------------------


def _flip(path: Path, rng: random.Random) -> int:
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return at


def _cut(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:rng.randrange(len(data))])


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _shards(root: Path) -> list[str]:
    return [s["file"] for s in json.loads((root / "hf" / "data" / "manifest.json").read_text())["shards"]]


WRONG = [("total_tokens", "100"), ("total_tokens", -5), ("total_tokens", 1.5), ("vocab_size", [256]),
         ("vocab_size", 0), ("shards", {"file": "x"}), ("tokenizer", "bytes"), ("shards[0]", ["x", 5]),
         ("shards[0].tokens", "12"), ("shards[0].file", 3), ("shards[0].sha256", 7)]
DELETABLE = ["total_tokens", "vocab_size", "shards", "shards[0].file", "shards[0].tokens"]


def _at(data: dict, where: str):
    """(container, key) of a path such as ``shards[0].tokens`` in a manifest."""
    node, key = data, where
    if where.startswith("shards[0]"):
        node, key = data["shards"], 0
        if where != "shards[0]":
            node, key = node[0], where.split(".", 1)[1]
    return node, key


def data_mishaps(rng: random.Random, shards: list[str]) -> list[Mishap]:
    manifest = "hf/data/manifest.json"
    shard = rng.choice(shards)
    wrong_key, wrong_value = rng.choice(WRONG)
    gone = rng.choice(DELETABLE)
    delta = rng.choice([-2, -1, 1, 2])

    def count(root):
        _edit_json(root / manifest, lambda m: m["shards"][shards.index(shard)].update(
            tokens=m["shards"][shards.index(shard)]["tokens"] + delta))

    def wrong(root):
        _edit_json(root / manifest, lambda m: _at(m, wrong_key)[0].__setitem__(_at(m, wrong_key)[1], wrong_value))

    def delete(root):
        _edit_json(root / manifest, lambda m: _at(m, gone)[0].pop(_at(m, gone)[1]))

    bare = wrong_key.split(".")[-1].split("[")[0]
    return [
        Mishap("data", f"flip a bit of {shard}", lambda root: _flip(root / "hf/data" / shard, rng), "plan", (shard,)),
        Mishap("data", f"cut {shard} short", lambda root: _cut(root / "hf/data" / shard, rng), "plan", (shard,)),
        Mishap("data", f"delete {shard}", lambda root: (root / "hf/data" / shard).unlink(), "plan", (shard,)),
        Mishap("data", f"{shard} token count {delta:+d}", count, "plan", (shard,)),
        Mishap("data", f"total_tokens {delta:+d}", lambda root: _edit_json(
            root / manifest, lambda m: m.update(total_tokens=m["total_tokens"] + delta)), "plan", ("total_tokens",)),
        Mishap("data", f"manifest {wrong_key} = {wrong_value!r}", wrong, "plan+loader", (bare, "shards[0]")),
        Mishap("data", f"manifest without {gone}", delete, "plan+loader", (gone.split(".")[-1].split("[")[0],
                                                                            "shards[0]")),
        Mishap("data", "manifest of random bytes", lambda root: (root / manifest).write_bytes(rng.randbytes(200)),
               "plan", ("manifest.json",)),
        Mishap("data", "manifest without checksums", lambda root: _edit_json(
            root / manifest, lambda m: [s.pop("sha256") for s in m["shards"]]), "plan", ("manifest.json",), "warn"),
    ]


def raw_mishaps(rng: random.Random) -> list[Mishap]:
    def raw(root: Path) -> Path:
        return next(p for p in (root / "hf/data/.raw-tokens").iterdir() if p.suffix == ".uint8")

    def zero(root):
        path = raw(root)
        data = bytearray(path.read_bytes())
        at = rng.randrange(len(data) - 64)
        data[at:at + 64] = bytes(64)
        path.write_bytes(bytes(data))

    return [
        Mishap("raw cache", "flip a bit of the raw token file", lambda root: _flip(raw(root), rng), "loader",
               (".raw-tokens",), "rebuild"),
        Mishap("raw cache", "cut the raw token file short", lambda root: _cut(raw(root), rng), "loader",
               (".raw-tokens",), "rebuild"),
        Mishap("raw cache", "zero 64 bytes of the raw token file", zero, "loader", (".raw-tokens",), "rebuild"),
        Mishap("raw cache", "raw token file without its checksums", lambda root: raw(root).with_name(
            raw(root).name + ".sha256").unlink(missing_ok=True), "loader", (".raw-tokens",), "rebuild"),
    ]


def _step(root: Path) -> Path:
    return next((root / "gen/run/checkpoints").glob("step-*"))


def checkpoint_mishaps(rng: random.Random, tool: str) -> list[Mishap]:
    which = rng.choice([".metadata", "__0_0.distcp"])

    def resealed(damage):
        def run(root):
            damage(_step(root) / which)
            reseal(_step(root))
        return run

    def planted(root):
        (_step(root) / ".metadata").write_bytes(payload(root / "ran"))
        reseal(_step(root))

    return [
        Mishap("checkpoint", f"flip a bit of {which}", lambda root: _flip(_step(root) / which, rng), tool, (which,)),
        Mishap("checkpoint", f"cut {which} short", lambda root: _cut(_step(root) / which, rng), tool, (which,)),
        Mishap("checkpoint", f"cut {which} short, manifest written again", resealed(lambda p: _cut(p, rng)), tool,
               ("step-00000001",)),
        Mishap("checkpoint", f"random bytes for {which}, manifest written again", resealed(
            lambda p: p.write_bytes(rng.randbytes(rng.randrange(1, 300)))), tool, ("step-00000001",)),
        Mishap("checkpoint", f"{which} deleted, manifest written again", resealed(lambda p: p.unlink()), tool,
               (which,)),
        Mishap("checkpoint", "a pickle planted in .metadata, manifest written again", planted, tool, (".metadata",)),
        Mishap("checkpoint", "manifest deleted", lambda root: (_step(root) / "raymesh-manifest.json").unlink(), tool,
               ("raymesh-manifest.json",)),
    ]


def _tensors(root: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = root / "hf/model/model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def hf_mishaps(rng: random.Random) -> list[Mishap]:
    dtype = rng.choice([torch.int32, torch.int8, torch.bool, torch.uint8, torch.float8_e4m3fn])
    key = rng.choice([Q, "model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight"])
    size_key = rng.choice(["hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"])
    bad_value = rng.choice([None, "32", -1, 0, 2.5, True])
    poison = rng.choice([float("nan"), float("inf"), float("-inf")])
    config = "hf/model/config.json"

    def poisoned(tensors):
        flat = tensors[key].view(-1)
        flat[rng.randrange(flat.numel())] = poison

    def tied(root):
        _edit_json(root / config, lambda c: c.update(tie_word_embeddings=True))

    return [
        Mishap("hf", "cut model.safetensors short", lambda root: _cut(root / "hf/model/model.safetensors", rng),
               "plan", ("model.safetensors",)),
        Mishap("hf", f"{key} stored as {dtype}", lambda root: _tensors(
            root, lambda t: t.update({key: t[key].to(dtype)})), "plan", (key,)),
        Mishap("hf", f"{key} one row short", lambda root: _tensors(
            root, lambda t: t.update({key: t[key][:-1].contiguous()})), "plan", (key,)),
        Mishap("hf", f"{key} deleted", lambda root: _tensors(root, lambda t: t.pop(key)), "plan", (key,)),
        Mishap("hf", f"config.json {size_key} = {bad_value!r}", lambda root: _edit_json(
            root / config, lambda c: c.update({size_key: bad_value})), "plan", (size_key,)),
        Mishap("hf", "config.json of random bytes", lambda root: (root / config).write_bytes(rng.randbytes(100)),
               "plan", ("config.json",)),
        Mishap("hf", f"{poison} in {key}", lambda root: _tensors(root, poisoned), "plan+read", (key,)),
        Mishap("hf", "tie_word_embeddings: true over a distinct head", tied, "plan", ("lm_head.weight",)),
    ]


def tokenizer_mishaps(rng: random.Random) -> list[Mishap]:
    from workers.data.tokenizer import train_bpe

    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"]) for _ in range(200))
    tokenizer = "gen/data/tokenizer.json"
    return [
        Mishap("tokenizer", "tokenizer.json swapped for another BPE", lambda root: train_bpe(
            [words.encode()] * 20, 300, root / tokenizer), "generate", ("tokenizer.json",)),
        Mishap("tokenizer", "tokenizer.json cut short", lambda root: _cut(root / tokenizer, rng), "generate",
               ("tokenizer.json",)),
        Mishap("tokenizer", "tokenizer.json deleted", lambda root: (root / tokenizer).unlink(), "generate",
               ("tokenizer",)),
    ]


def mishaps(pristine_root: Path, seed: int, rounds: int = 3) -> list[Mishap]:
    """Every kind of mishap ``rounds`` times, each round's random choices (which shard, byte, key, dtype, value)
    drawn from ``seed``; a checkpoint is read by ``generate`` and ``export-hf`` in turn."""
    rng = random.Random(seed)
    shards = _shards(pristine_root)
    out = []
    for i in range(rounds):
        out += [*data_mishaps(rng, shards), *raw_mishaps(rng), *checkpoint_mishaps(rng, TOOLS[i % len(TOOLS)]),
                *hf_mishaps(rng), *tokenizer_mishaps(rng)]
    return out


# -- opening ---------------------------------------------------------------------------------------------------


def _cli(argv: list[str]) -> tuple[int | str, str]:
    """``raymesh ARGV`` in this process: (exit code, or "traceback", and what it wrote to stderr)."""
    from orchestrator.cli.commands import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except BaseException:  # an escaped exception is what is being looked for
        return "traceback", traceback.format_exc()
    return code, err.getvalue()


def _call(func, *args) -> tuple[int | str, str]:
    """``func(*args)`` as the CLI would report it: 0, 2 and the message of a refusal, or a traceback."""
    from orchestrator.errors import SpecError

    try:
        func(*args)
    except (SpecError, ValueError, FileNotFoundError) as exc:
        if type(exc).__name__ in ("JSONDecodeError", "UnicodeDecodeError"):
            return "traceback", traceback.format_exc()
        return 2, str(exc)
    except Exception:
        return "traceback", traceback.format_exc()
    return 0, ""


class _Logged(logging.Handler):
    """Every record of the loggers it is added to (the driver's events are logged at INFO)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


@contextlib.contextmanager
def _warnings():
    """Warning lines the loader logs and ``event=`` lines the driver logs, while the block runs."""
    handler = _Logged()
    loggers = [logging.getLogger("workers.data.loader"), logging.getLogger("raymesh")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def _open_data(root: Path) -> np.ndarray:
    from workers.data.loader import TokenDataset

    ds = TokenDataset(root / "hf/data", seq_len=16, seed=0)
    return ds.store.read(0, len(ds.store))


def _read_weights(root: Path) -> None:
    from orchestrator.spec import load_spec
    from workers.model.hf_io import load_hf_weights
    from workers.model.registry import build_model, model_config

    spec = load_spec(str(root / "hf/job.yaml"), [])
    model = build_model(model_config({**spec.model.model_dump(), "d_ff": spec.model.ffn_dim}))
    load_hf_weights(model, spec.model.init_from)


def open_through(mishap: Mishap, root: Path) -> tuple[int | str, str]:
    """Open the damaged inputs at ``root`` the way ``mishap.through`` says: (0 or 2 or "traceback", message)."""
    job = str(root / ("gen" if mishap.area in ("checkpoint", "tokenizer") else "hf") / "job.yaml")
    if mishap.through == "generate":
        return _cli(["generate", job, "--max-new-tokens", "2", "--checkpoint", str(_step(root))])
    if mishap.through == "export-hf":
        return _cli(["export-hf", job, "--checkpoint", str(_step(root)), "--out", str(root / "exported")])
    code, text = _cli(["plan", job])
    if code != 0 or mishap.through == "plan":
        return code, text
    return _call(_open_data if mishap.through == "plan+loader" else _read_weights, root)


def judge(mishap: Mishap, pristine_root: Path, case: Path, expected_stream: np.ndarray) -> Outcome:
    """Damage a fresh copy, open it, and say how it ended (``BUGS`` are the wrong ways)."""
    root = workspace(pristine_root, case)
    mishap.damage(root)
    if mishap.expect == "rebuild":
        with _warnings() as lines:
            code, text = _call(_open_data, root)
            stream = _open_data(root) if code == 0 else None
        named = any(n in line for line in lines for n in mishap.names)
        if code == "traceback":
            return Outcome(mishap, "traceback", text)
        rebuilt = stream is not None and np.array_equal(stream, expected_stream) and named
        return Outcome(mishap, "rebuilt" if rebuilt else "not rebuilt", text or "\n".join(lines))
    with _warnings() as lines:
        code, text = open_through(mishap, root)
    if (root / "ran").exists():
        return Outcome(mishap, "ran code", text)
    if code == "traceback" or "Traceback" in text:
        return Outcome(mishap, "traceback", text)
    if mishap.expect == "warn":
        warned = any(n in line for line in lines for n in mishap.names)
        return Outcome(mishap, "warned" if code == 0 and warned else "unnamed", text or "\n".join(lines))
    if code == 0:
        return Outcome(mishap, "accepted", text)
    named = any(n in text for n in mishap.names)
    return Outcome(mishap, "refused" if named else "unnamed", text)


def run(work: Path, seed: int = 7, rounds: int = 3) -> list[Outcome]:
    """Every mishap of ``seed`` judged, each on its own copy under ``work``."""
    import time

    base = pristine(work / "pristine")
    stream = _open_data(base)
    outcomes = []
    for i, mishap in enumerate(mishaps(base, seed, rounds)):
        t = time.perf_counter()
        outcome = judge(mishap, base, work / f"case-{i:03d}", stream)
        outcome.seconds = time.perf_counter() - t
        outcomes.append(outcome)
        shutil.rmtree(work / f"case-{i:03d}", ignore_errors=True)
    return outcomes


def summary(outcomes: list[Outcome]) -> Counter:
    return Counter(o.verdict for o in outcomes)


def bugs(outcomes: list[Outcome]) -> list[tuple[str, str, str, str]]:
    """(verdict, area, mishap, the last line said) of each outcome that ended a wrong way (``BUGS``)."""
    return [(o.verdict, o.mishap.area, o.mishap.name, (o.detail.strip().splitlines() or [""])[-1])
            for o in outcomes if o.verdict in BUGS]


if __name__ == "__main__":
    results = run(Path(sys.argv[1]), seed=int(sys.argv[2]) if len(sys.argv) > 2 else 7)
    print(dict(summary(results)))
    for o in results:
        print(f"{o.verdict:12s} {o.seconds:5.2f}s {o.mishap.area:10s} {o.mishap.name}: "
              f"{(o.detail.strip().splitlines() or [''])[-1][:200]}")
