"""Peak memory and time of the head and cross entropy with `train.loss_chunks`, against the whole logits.

One forward and backward of ``head(hidden)`` and the float32 token loss (``workers/model/gpt.py``: ``lm_loss`` on
the whole logits for chunks=1, ``chunked_lm_loss`` otherwise) at a real vocabulary (Llama 3's 128,256 words by
default), each chunk count in a fresh subprocess so no heap history carries over. Memory is the process's
``VmHWM`` (``/proc/self/status``) less its ``VmRSS`` just before the step: what the step itself added at its
peak. Not ``resource.getrusage``'s ``ru_maxrss``: across fork and exec Linux carries the parent's peak into it.
Time is the fastest of ``--repeats`` steps after the one measured for memory. Both as ratios against chunks=1
measured in the same run.

    python benchmarks/loss_chunks.py --out benchmarks/results/loss_chunks.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _status_bytes(name: str) -> int:
    """One ``/proc/self/status`` field (kB there) in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{name}:"))
    return int(line.split()[1]) * 1024


def _step(hidden, targets, head, chunks: int) -> float:
    """One forward and backward of the head and loss; its seconds."""
    from workers.model.gpt import chunked_lm_loss, lm_loss

    start = time.perf_counter()
    hidden.grad, head.weight.grad = None, None
    loss = lm_loss(head(hidden), targets) if chunks == 1 else chunked_lm_loss(hidden, targets, head, chunks)
    loss.backward()
    return time.perf_counter() - start


def child(chunks: int, tokens: int, d_model: int, vocab: int, repeats: int) -> dict:
    """In a fresh process: the step's peak above what was resident before it, and its fastest time."""
    import torch

    torch.manual_seed(0)
    hidden = torch.randn(1, tokens, d_model, requires_grad=True)
    head = torch.nn.Linear(d_model, vocab, bias=False)
    targets = torch.randint(0, vocab, (1, tokens))
    before = _status_bytes("VmRSS")
    _step(hidden, targets, head, chunks)
    peak = _status_bytes("VmHWM") - before
    seconds = min(_step(hidden, targets, head, chunks) for _ in range(repeats))
    return {"chunks": chunks, "step_peak_bytes": peak, "seconds": seconds}


def measure(args: argparse.Namespace) -> list[dict]:
    """Every chunk count in its own subprocess; ratios against chunks=1 of the same run."""
    rows = []
    for chunks in args.chunks:
        cmd = [sys.executable, __file__, "--child", str(chunks), "--tokens", str(args.tokens), "--d-model",
               str(args.d_model), "--vocab", str(args.vocab), "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = next(r for r in rows if r["chunks"] == 1)
    for r in rows:
        r["peak_vs_1"] = round(r["step_peak_bytes"] / base["step_peak_bytes"], 3)
        r["time_vs_1"] = round(r["seconds"] / base["seconds"], 3)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.tokens, args.d_model, args.vocab, args.repeats)))
        return
    if 1 not in args.chunks:
        args.chunks = [1, *args.chunks]
    rows = measure(args)
    for r in rows:
        print(f"chunks {r['chunks']:>3}: step peak {r['step_peak_bytes'] / 2**30:6.2f} GiB ({r['peak_vs_1']:.3f}x), "
              f"{r['seconds']:6.2f} s ({r['time_vs_1']:.2f}x)")
    if args.out:
        import torch

        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
                                        "memory": "VmHWM less VmRSS before the step", "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
