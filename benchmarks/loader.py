"""Loader throughput and resident memory for the default corpus and one 50x larger.

The 50x corpus is the default one's shards repeated 50 times under one manifest (so it costs disk, not
tokenizing time). Each corpus is measured in a fresh subprocess, so its peak RSS (``VmHWM``) is the loader's:
build a ``TokenDataset`` (which checks every shard's checksum) and a ``DataCursor``, then time ``--steps``
batches of ``--batch`` windows of ``--seq-len`` tokens.

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

FACTOR = 50


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


def measure(path: str, seq_len: int, batch: int, steps: int) -> dict:
    """One corpus, in this process: open time, tokens/s over ``steps`` batches, peak and final RSS."""
    from workers.data import DataCursor, TokenDataset

    t0 = time.perf_counter()
    dataset = TokenDataset(path, seq_len, seed=0)
    cursor = DataCursor(dataset, batch, dp_rank=0, dp_size=1)
    opened = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        cursor.next_batch()
    elapsed = time.perf_counter() - t0
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    total = json.loads((Path(path) / "manifest.json").read_text())["total_tokens"]
    return {"tokens": total, "open_s": round(opened, 2),
            "tokens_per_s": round(steps * batch * seq_len / elapsed), "steps": steps,
            "peak_rss_mib": round(int(status["VmHWM"].split()[0]) / 1024, 1),
            "rss_mib": round(int(status["VmRSS"].split()[0]) / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/stdlib", help="a prepared corpus (raymesh prepare-data)")
    ap.add_argument("--scratch", default="/tmp/raymesh-loader-bench", help="where the 50x corpus is built")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/loader.json")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # the child's mode: one corpus
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.seq_len, args.batch, args.steps)))
        return
    corpora = {"default": Path(args.data), f"{FACTOR}x": repeat_corpus(Path(args.data), Path(args.scratch), FACTOR)}
    report = {"seq_len": args.seq_len, "batch": args.batch}
    for name, path in corpora.items():
        child = subprocess.run([sys.executable, __file__, "--measure", str(path), "--seq-len", str(args.seq_len),
                                "--batch", str(args.batch), "--steps", str(args.steps)],
                               capture_output=True, text=True, check=True)
        report[name] = json.loads(child.stdout.strip().splitlines()[-1])
        print(name, report[name], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
