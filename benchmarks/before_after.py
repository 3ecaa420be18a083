"""A benchmark on an earlier tree and on this one, in one run, alternating: the figures a change claims.

These machines are noisy, so a change's effect is measured as the same benchmark run on the tree before it
(``--base``, checked out into a temporary worktree) and on this checkout, one after the other, ``--rounds``
times each (base, this, base, this, ...), every result kept. Each run writes its own JSON; this writes one
file holding all of them under ``before`` and ``after``, with the command.

    python benchmarks/before_after.py --base main --out before_after.json -- benchmarks/overhead.py --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(tree: Path, command: list[str], out: Path) -> dict:
    """``command`` (a script path relative to the tree, then its arguments) in ``tree``, its ``--out`` JSON."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / command[0]), *command[1:], "--out", str(out)], cwd=tree, env=env,
                   check=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision before the change (a commit, branch or tag)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: the benchmark, without --out")
    args = ap.parse_args()
    command = [c for c in args.command if c != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True)
        try:
            rows: dict[str, list] = {"before": [], "after": []}
            for i in range(args.rounds):
                for side, tree in (("before", base), ("after", ROOT)):
                    rows[side].append(run(tree, command, Path(tmp) / f"{side}-{i}.json"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    revision = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    Path(args.out).write_text(json.dumps({"command": " ".join(command), "base": args.base,
                                          "after": revision.strip(), **rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
