"""The ``raymesh`` command line.

``commands``: prepare-data, plan, run, attach, report, export-merged (``follow`` hosts and follows
runs); ``jobs``: submit, status, logs, stop, inject, scale.
"""

from orchestrator.cli.commands import main

__all__ = ["main"]
