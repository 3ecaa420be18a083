"""Streaming loader against the old whole-corpus-in-memory loader, on the default corpus and one 50x larger.

The 50x corpus is the default one's shards repeated 50 times under one manifest (so it costs disk, not
tokenizing time). Each (loader, corpus) pair runs in a fresh subprocess, so its peak RSS (``VmHWM``) is that
loader's. The streaming loader (``TokenDataset`` + ``DataCursor``) is opened twice: first with no raw token
file (what the first rank on a host pays: checksums, then decoding the corpus once into ``.raw-tokens/``), then
again (what every other rank and later run pays). The baseline is the loader this one replaced, kept here as the
reference: every shard read into one array, a batch one fancy index. Throughput is measured in one more
process holding both loaders, timed in turns (``--repeats`` rounds of ``--steps`` batches, the best), so the
streaming / in-memory ratio compares the two under the same load; both read epoch 0's windows in the same
order (past its end the streaming loader goes on to the next epoch's permutation, the baseline repeats epoch 0's).

    python benchmarks/loader.py --data data/stdlib --scratch /tmp/raymesh-loader-bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root
from benchmarks.provenance import write_result

FACTOR = 50
LOADERS = ("streaming", "in-memory")


def repeat_corpus(src: Path, out: Path, factor: int) -> Path:
    """``src``'s shards ``factor`` times over, hard-linked where the filesystem allows, under one manifest."""
    manifest = json.loads((src / "manifest.json").read_text())
    if (out / "manifest.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for _ in range(factor):
        for shard in manifest["shards"]:
            name = f"shard-{len(shards):05d}.parquet"
            try:
                (out / name).hardlink_to(src / shard["file"])
            except OSError:
                shutil.copyfile(src / shard["file"], out / name)
            shards.append({**shard, "file": name})
    big = {**manifest, "shards": shards, "total_tokens": manifest["total_tokens"] * factor}
    (out / "manifest.json").write_text(json.dumps(big))
    return out


class InMemoryLoader:
    """The baseline: the previous loader's reads (every token of the corpus in one array, checksums checked
    first; a batch is one fancy index over its windows), in ``TokenDataset``'s epoch 0 order for seed 0,
    repeated past its end."""

    def __init__(self, path: Path, seq_len: int) -> None:
        import pyarrow.parquet as pq

        from workers.data import checksums

        manifest = json.loads((path / "manifest.json").read_text())
        parts = []
        for shard in manifest["shards"]:
            checksums.verify_shard(path, shard)
            table = pq.read_table(path / shard["file"], columns=["tokens"], memory_map=True)
            parts.extend(c.to_numpy(zero_copy_only=True) for c in table.column("tokens").chunks)
        self.tokens = np.concatenate(parts)
        self.seq_len = seq_len
        self.order = np.random.default_rng([0, 0]).permutation((len(self.tokens) - 1) // seq_len)
        self.position = 0

    def next_batch(self, count: int):
        import torch

        ids = self.order[np.arange(self.position, self.position + count) % len(self.order)]
        self.position += count
        windows = torch.from_numpy(self.tokens[ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)]
                                   .astype(np.int64))
        return windows[:, :-1], windows[:, 1:]


def _rss_mib() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {f"{key}_mib": round(int(status[name].split()[0]) / 1024, 1)
            for key, name in (("peak_rss", "VmHWM"), ("rss", "VmRSS"))}


def _open(loader: str, path: Path, seq_len: int, batch: int):
    """A ``next()`` for ``batch`` windows from a fresh ``loader``, plus the seconds opening it took."""
    from workers.data import DataCursor, TokenDataset

    t0 = time.perf_counter()
    if loader == "in-memory":
        reader = InMemoryLoader(path, seq_len)
        return (lambda: reader.next_batch(batch)), time.perf_counter() - t0
    cursor = DataCursor(TokenDataset(path, seq_len, seed=0), batch, dp_rank=0, dp_size=1)
    return cursor.next_batch, time.perf_counter() - t0


def memory(loader: str, path: Path, seq_len: int, batch: int, steps: int) -> dict:
    """One loader alone in this process: open time(s), then ``steps`` batches; peak and final RSS."""
    report = {}
    if loader == "streaming":
        from workers.data.loader import RAW_DIR

        shutil.rmtree(path / RAW_DIR, ignore_errors=True)
        first, report["open_first_s"] = _open(loader, path, seq_len, batch)
        del first
    take, report["open_s"] = _open(loader, path, seq_len, batch)
    for _ in range(steps):
        take()
    return {**{k: round(v, 2) for k, v in report.items()}, **_rss_mib()}


def speed(path: Path, seq_len: int, batch: int, steps: int, repeats: int) -> dict:
    """Both loaders in this process, timed in turns (``repeats`` rounds of ``steps`` batches each), so a noisy
    machine slows both alike; each one's best round (as ``timeit`` advises: other load only ever slows a round
    down, so the fastest is the closest to the loader's own cost)."""
    takes = {loader: _open(loader, path, seq_len, batch)[0] for loader in LOADERS}
    rates: dict[str, list[float]] = {loader: [] for loader in LOADERS}
    for _ in range(repeats):
        for loader, take in takes.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                take()
            rates[loader].append(steps * batch * seq_len / (time.perf_counter() - t0))
    return {loader: round(max(r)) for loader, r in rates.items()}


def _child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/stdlib", help="a prepared corpus (raymesh prepare-data)")
    ap.add_argument("--scratch", default="/tmp/raymesh-loader-bench", help="where the 50x corpus is built")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/loader.json")
    ap.add_argument("--memory", nargs=2, help=argparse.SUPPRESS)  # a child: LOADER CORPUS
    ap.add_argument("--speed", help=argparse.SUPPRESS)  # a child: CORPUS
    args = ap.parse_args()
    shape = ["--seq-len", str(args.seq_len), "--batch", str(args.batch), "--steps", str(args.steps)]
    if args.memory:
        print(json.dumps(memory(args.memory[0], Path(args.memory[1]), args.seq_len, args.batch, args.steps)))
        return
    if args.speed:
        print(json.dumps(speed(Path(args.speed), args.seq_len, args.batch, args.steps, args.repeats)))
        return
    corpora = {"default": Path(args.data), f"{FACTOR}x": repeat_corpus(Path(args.data), Path(args.scratch), FACTOR)}
    report: dict = {"seq_len": args.seq_len, "batch": args.batch, "steps": args.steps, "repeats": args.repeats}
    for name, path in corpora.items():
        runs = report[name] = {"tokens": json.loads((path / "manifest.json").read_text())["total_tokens"]}
        for loader in LOADERS:  # the streaming child first: it builds the raw file the speed child then opens
            runs[loader] = _child("--memory", loader, str(path), *shape)
        for loader, rate in _child("--speed", str(path), *shape, "--repeats", str(args.repeats)).items():
            runs[loader]["tokens_per_s"] = rate
        runs["throughput_ratio"] = round(runs["streaming"]["tokens_per_s"] / runs["in-memory"]["tokens_per_s"], 2)
        runs["peak_rss_ratio"] = round(runs["streaming"]["peak_rss_mib"] / runs["in-memory"]["peak_rss_mib"], 2)
        print(name, json.dumps(runs), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, report, args.data)


if __name__ == "__main__":
    main()
