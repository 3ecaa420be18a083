"""The ``raymesh`` command line.

``commands``: prepare-data, plan, run, report, export-merged; ``jobs``: submit, status, logs, stop, inject, scale.
"""

from orchestrator.cli.commands import main

__all__ = ["main"]
