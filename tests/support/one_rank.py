"""A ``Trainer`` of the tiny job on one gloo rank in the test's own process: the worker seam without Ray or the
harness's child processes, for unit tests of what one rank does (snapshots, checkpoints, step records)."""

from __future__ import annotations

import contextlib
import sysconfig
from pathlib import Path

from orchestrator.spec import JobSpec
from tests.support.environ import kept_env
from tests.support.jobs import tiny_spec


@contextlib.contextmanager
def one_rank_trainer(tmp_path_factory, data: dict | None = None, extra: dict | None = None,
                     objective: str | None = None, **sections):
    """The trainer of ``tiny_spec`` with ``sections`` over a small prepared corpus (or the ``data`` section given,
    e.g. a ``mix``), ``extra`` keys added to its spec dict as the controller adds them (``ps_routes``), and
    ``objective`` as its ``train.objective`` (one a test registered, which the job file's schema does not list);
    its group is destroyed after (one process holds one default group, so a module holds one of these at a time)."""
    import torch.distributed as dist

    from workers.data.prepare import prepare_data
    from workers.parallel.process_group import LINK_INTERFACE_VARS, listen_on
    from workers.trainer import Trainer

    corpus = tmp_path_factory.mktemp("tokens")
    prepare_data([Path(sysconfig.get_paths()["stdlib"]) / "json"], corpus)
    spec = tiny_spec(corpus, tmp_path_factory.mktemp("run"), **sections)
    if data is not None:
        spec = JobSpec.from_dict({**spec.to_dict(), "data": data})
    spec = {**spec.worker_dict(), **(extra or {})}
    if objective is not None:
        spec["train"] = {**spec["train"], "objective": objective}
    listener = listen_on("127.0.0.1")  # bound until the store takes it: no other process can take the port
    with kept_env(*LINK_INTERFACE_VARS):  # a loopback group sets them in this process: the test session's
        trainer = Trainer(spec, 0, 1, "127.0.0.1", listener.getsockname()[1], listener=listener)
        try:
            yield trainer
        finally:
            trainer.checkpoints.wait()
            dist.destroy_process_group()
