"""``python -m orchestrator.cli`` is ``raymesh``."""

from orchestrator.cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
