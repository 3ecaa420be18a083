"""A seeded fuzzer for job files: mutate a valid job field by field and run `raymesh plan` on each mutation.

Every mutation must end in one of two ways: `plan` accepts it, or it refuses it with a `raymesh: error:` line that
names the field (or, for damage to the file itself, the key and line or byte offset). A traceback is a bug, and so
is accepting a mutation of a known-bad class (`known_bad`): non-finite numbers, booleans or strings where a number
is expected, unknown keys, fields in the wrong section, duplicate keys, bytes that are not UTF-8.

`plan` runs in-process (`orchestrator.cli.commands.main`), which keeps 500+ mutations to seconds; the CLI's own
subprocess path is proven once by the test. `python -m tests.support.spec_fuzz DIR` prints the counts.
"""

from __future__ import annotations

import contextlib
import copy
import io
import random
import signal
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.spec.raw import add_exponent_floats

TEXT = ("def tokens(n):\n    return [i % 256 for i in range(n)]\n" * 400)  # ~20K byte tokens of data


def base_job(data: Path, run_dir: Path) -> dict[str, Any]:
    """A valid job that touches every section `plan` reads (small, so each validation is cheap)."""
    return {
        "name": "fuzz-base",
        "run_dir": str(run_dir),
        "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32,
                  "norm_eps": 1e-5, "init_std": 0.02, "positions": "rotary"},
        "data": {"path": str(data), "seed": 1},
        "parallel": {"dp": 2, "pp": 1, "tp": 1, "zero": 0, "pp_schedule": "1f1b", "sequence_parallel": True,
                     "device": "cpu", "cpus_per_rank": 1.0, "device_memory": "8GB"},
        "optim": {"name": "adamw", "lr": 0.003, "weight_decay": 0.01, "betas": [0.9, 0.95], "momentum": 0.0,
                  "grad_clip": 1.0, "warmup_steps": 2, "schedule": "cosine", "min_lr_ratio": 0.1},
        "precision": {"dtype": "fp32", "initial_loss_scale": 65536.0},  # the default: fp32 has no loss scaling
        "memory": {"recompute": "none", "activation_compression": "none", "measure": False,
                   "offload": {"optimizer": False, "tier": "cpu", "prefetch": 1}},
        "train": {"steps": 10, "global_batch_size": 8, "microbatches": 2, "seed": 3, "log_every": 1},
        "checkpoint": {"every": 5, "keep": 2, "async": False, "memory_every": 2},
        "metrics": {"port": 0, "timeline": False, "peak_tflops_per_rank": 10.0},
        "fault_tolerance": {"heartbeat_timeout_s": 120.0, "collective_timeout_s": 60.0, "max_restarts": 3,
                            "straggler_ratio": 1.5, "straggler_steps": 3, "min_dp": 1},
        "faults": [{"kind": "slow_rank", "rank": 1, "at_step": 3, "factor": 2.0}],
    }


@dataclass
class Mutation:
    """One mutated job: the file's bytes, overrides to pass with `--set`, what the refusal must name."""

    name: str
    data: bytes
    sets: list[str] = field(default_factory=list)
    names: tuple[str, ...] = ()  # the refusal must mention one of these
    known_bad: bool = False


def _leaves(node: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(node, list) and node and isinstance(node[0], dict):
        return [leaf for i, v in enumerate(node) for leaf in _leaves(v, (*path, i))]
    return [(path, node)]


def _set(raw: dict, path: tuple, value: Any) -> dict:
    out = copy.deepcopy(raw)
    node = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


class _Dumper(yaml.SafeDumper):
    """Quotes a string such as "1e-05" that the job loader would read back as a number."""


add_exponent_floats(_Dumper)
ACCEPTS_NUMBERS = {"device_memory"}  # a size written as bytes or as text ("8GB")
DEADLINE_S = 5  # a mutation `plan` takes longer than this on is a hang


def _dump(raw: Any, flow: bool = False) -> bytes:
    return yaml.dump(raw, Dumper=_Dumper, sort_keys=False, allow_unicode=True, default_flow_style=flow).encode()


def _values(key: str, value: Any) -> list[tuple[str, Any, bool]]:
    """(class, mutated value, known bad) for one leaf, by its type in the valid job."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    out = [("null", None, False), ("list", [1, 2], not isinstance(value, list)),
           ("dict", {"k": 1}, True), ("bool", True, not isinstance(value, bool))]
    if number:
        whole = isinstance(value, int)
        out += [("negative", -value if value else -1, False), ("zero", 0, False), ("large", 10**7, False),
                ("huge", 10**30 if whole else 1e300, False), ("inf", float("inf"), True),
                ("-inf", float("-inf"), True), ("nan", float("nan"), True), ("string", "abc", True),
                ("numeric-string", str(value), True)]
        if whole:
            out.append(("fraction", value + 0.5, True))
    elif isinstance(value, bool):
        out += [("int-for-bool", 1, True), ("string", "maybe", True)]
    elif isinstance(value, str):
        out += [("number", 7, key not in ACCEPTS_NUMBERS), ("empty", "", False), ("long", "x" * 5000, True),
                ("nul", "a\x00b", True), ("slash", "a/b", False)]
    elif isinstance(value, list):
        out += [("empty-list", [], False), ("nan-items", [float("nan"), 0.5], True)]
    return out


def _value_mutations(raw: dict, rng: random.Random) -> list[Mutation]:
    out = []
    for path, value in _leaves(raw):
        key = str(path[-1])
        for cls, new, bad in _values(key, value):
            name = f"{'.'.join(map(str, path))}={cls}"
            if "faults" not in path and rng.random() < 0.25:  # a seeded quarter goes through `--set`
                text = _dump(new, flow=True).decode().strip().removesuffix("...").strip()
                sets = [f"{'.'.join(map(str, path))}={text}"]
                out.append(Mutation(f"--set {name}", _dump(raw), sets, (key,), bad))
            else:
                out.append(Mutation(name, _dump(_set(raw, path, new)), [], (key,), bad))
    return out


def _structure_mutations(raw: dict) -> list[Mutation]:
    """Unknown keys in every section and at the top, and every field moved into a section it is not in."""
    sections = [k for k, v in raw.items() if isinstance(v, dict)]
    out = [Mutation("top-level unknown key", _dump({**raw, "bogus": 1}), [], ("bogus",), True)]
    for s in sections:
        out.append(Mutation(f"{s}.bogus", _dump(_set(raw, (s, "bogus_key"), 1)), [], ("bogus_key",), True))
    for path, value in _leaves(raw):
        if len(path) != 2 or not isinstance(path[0], str):
            continue
        for other in sections:
            if other != path[0] and path[1] not in raw[other]:
                moved = _set(raw, (other, path[1]), value)
                out.append(Mutation(f"{path[1]} moved to {other}", _dump(moved), [], (path[1],), True))
                break
    return out


def _duplicate_mutations(text: str) -> list[Mutation]:
    """Every `key:` line of the file written twice: a section header gets an empty copy before its block, a
    `key: value` line a copy with another value after it; either way the second one is on line i + 2."""
    lines = text.splitlines(keepends=True)
    out = []
    for i, line in enumerate(lines):
        key, sep, rest = line.strip().partition(":")
        if not sep or key.startswith("-"):
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if rest.strip():
            dup = [*lines[: i + 1], f"{indent}{key}: null\n", *lines[i + 1:]]
        else:
            dup = [*lines[:i], f"{indent}{key}: {{}}\n", *lines[i:]]
        out.append(Mutation(f"duplicate {key} (line {i + 1})", "".join(dup).encode(), [], (key, f"{i + 2}"), True))
    return out


def _byte_mutations(text: str, rng: random.Random, count: int) -> list[Mutation]:
    """Bytes that are not UTF-8 at seeded offsets, a binary file, UTF-16, and non-UTF-8 `--set` values."""
    data = text.encode()
    out = []
    for _ in range(count):
        at = rng.randrange(len(data))
        bad = rng.choice([b"\xff", b"\xc3", b"\x80", b"\xfe\xfe", b"\xed\xa0\x80"])
        out.append(Mutation(f"non-UTF-8 {bad!r} at byte {at}", data[:at] + bad + data[at:], [], ("byte",), True))
    out.append(Mutation("binary file", bytes(rng.randrange(256) for _ in range(512)), [], ("byte",), True))
    out.append(Mutation("UTF-16 file", text.encode("utf-16"), [], ("byte",), True))
    for key in ("train.steps", "name", "optim.lr", "data.path"):
        # what argv holds for bytes that are not UTF-8 (Python decodes them with surrogateescape)
        out.append(Mutation(f"--set {key} non-UTF-8", data, [f"{key}=a\udcff"], (key,), True))
    return out


def _filesystem_mutations(raw: dict, data: Path) -> list[Mutation]:
    """Paths the job cannot use, found on disk before any actor starts (`fuzz` makes `foreign` and `empty`).

    A data.path that does not exist is not among them: `plan` accepts it (data may live on the cluster only)."""
    work = data.parent
    foreign, empty = work / "foreign.txt", work / "empty"
    cases = [
        (("run_dir",), str(foreign), "run_dir"), (("checkpoint", "dir"), str(foreign), "checkpoint.dir"),
        (("metrics", "file_sd"), str(foreign), "metrics.file_sd"), (("data", "path"), str(empty), "data.path"),
        (("model", "seq_len"), 4096, "model.seq_len"), (("run_dir",), str(foreign / "run"), "run_dir"),
    ]
    out = [Mutation(f"{'.'.join(path)}=unusable", _dump(_set(raw, path, value)), [], (field,), True)
           for path, value, field in cases]
    nvme = _set(raw, ("memory", "offload"), {"optimizer": True, "tier": "nvme", "path": str(foreign)})
    out.append(Mutation("memory.offload.path=a file", _dump(nvme), [], ("memory.offload.path",), True))
    ps = _set(_set(raw, ("parallel", "dp_sync"), "ps"), ("optim", "name"), "sm3")
    ps["faults"] = []
    out.append(Mutation("ps with an optimizer the shards lack", _dump(ps), [], ("optim.name",), True))
    return out


def mutations(data: Path, run_dir: Path, seed: int = 13) -> list[Mutation]:
    """All mutations of the base job, in a fixed order for a seed."""
    rng = random.Random(seed)
    raw = base_job(data, run_dir)
    text = _dump(raw).decode()
    return (_value_mutations(raw, rng) + _structure_mutations(raw) + _duplicate_mutations(text)
            + _byte_mutations(text, rng, 40) + _filesystem_mutations(raw, data))


@dataclass
class Outcome:
    mutation: Mutation
    verdict: str  # accepted, refused, unnamed (refused without naming the field), silent, traceback, hang
    detail: str = ""


class _Hang(Exception):
    pass


def _deadline(*_: Any) -> None:
    raise _Hang(f"plan ran past {DEADLINE_S} s")


def run_plan(path: Path, sets: list[str]) -> tuple[int | str, str]:
    """`raymesh plan PATH --set ...` in this process: (exit code, stderr), ("traceback"/"hang", the traceback)."""
    from orchestrator.cli.commands import main

    err = io.StringIO()
    previous = signal.signal(signal.SIGALRM, _deadline)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = main(["plan", str(path), *(a for s in sets for a in ("--set", s))])
    except _Hang:
        return "hang", traceback.format_exc()
    except BaseException:  # any escape is the finding
        return "traceback", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return rc, err.getvalue()


def judge(mutation: Mutation, path: Path) -> Outcome:
    path.write_bytes(mutation.data)
    rc, text = run_plan(path, mutation.sets)
    if isinstance(rc, str):
        return Outcome(mutation, rc, text)
    if rc == 0:
        return Outcome(mutation, "silent" if mutation.known_bad else "accepted")
    named = "raymesh: error:" in text and "fix:" in text and all(n in text for n in mutation.names)
    return Outcome(mutation, "refused" if named else "unnamed", text)


def fuzz(workdir: Path, seed: int = 13) -> list[Outcome]:
    """Prepare a tiny corpus under `workdir`, then judge every mutation."""
    from workers.data import prepare_data

    workdir.mkdir(parents=True, exist_ok=True)
    src, data = workdir / "src.py", workdir / "data"
    src.write_text(TEXT)
    (workdir / "foreign.txt").write_text("a file raymesh did not write\n")
    (workdir / "empty").mkdir(exist_ok=True)
    if not (data / "manifest.json").exists():
        prepare_data([src], data)
    job = workdir / "job.yaml"
    return [judge(m, job) for m in mutations(data, workdir / "run", seed)]


BUGS = ("traceback", "hang", "silent", "unnamed")


def summary(outcomes: list[Outcome]) -> Counter:
    return Counter(o.verdict for o in outcomes)


if __name__ == "__main__":
    results = fuzz(Path(sys.argv[1]))
    print(f"{len(results)} mutations: {dict(summary(results))}")
    for o in results:
        if o.verdict in BUGS:
            print(f"--- {o.verdict}: {o.mutation.name} {o.mutation.sets}\n{o.detail.strip().splitlines()[-1:]}")
