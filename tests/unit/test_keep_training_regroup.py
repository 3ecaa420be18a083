"""`recovery: keep_training` on real ranks without Ray: survivors keep their trainers through both re-formations.

Three ``RankWorker``s (plain objects in spawned processes over gloo, as the Ray actors host them) train two steps;
rank 2's replica fails (it shuts its sockets, as a dying rank's connections close), so the others' third step breaks
in its all-reduce. They re-form a group of two (``setup(keep_trainer=...)`` with the survivors' specs the controller
sends), roll back, train two steps, then rank 2's replacement (a new worker) rejoins the full group from a live peer's
snapshot and all three train two more. In the kept run the replacement built its trainer alone first
(``RankWorker.prebuild``, while the others stepped) and moves it into the full group as the survivors do. Once keeping
the trainers, once rebuilding them (what every recovery did before): the losses and every rank's final state must be
the same bit for bit, and only the kept run's survivors hold the very trainer, model parameters and optimizer they
started with.
"""

from __future__ import annotations

import io
import os

import torch

from orchestrator.recovery.keep_training import survivor_specs
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import rank_ports, spawn_ranks
from tests.support.same_state import same_state

SECTIONS = {"parallel": {"dp": 3}, "train": {"steps": 8, "global_batch_size": 12},
            "fault_tolerance": {"recovery": "keep_training", "collective_timeout_s": 30}}
FAILED = 2


def _join(worker, ports, rank: int, group: int, spec: dict, index: int, world: int, keep: bool):
    """``worker`` joins gloo group ``group`` as ``index`` of ``world`` (rank 0 binds the store's socket)."""
    port, listener = ports.join(index, group)
    worker._listener = listener
    worker.setup(spec, index, world, "127.0.0.1", port, keep_trainer=keep)


def _steps(worker, n: int) -> list[float]:
    """``n`` steps, each snapshotted as the rank's loop does under ``checkpoint.memory_every: 1``."""
    return [worker.train_step(None, -1).loss for _ in range(n)]


def _worker():
    """A ``RankWorker`` outside Ray: its identity from the process (Ray's would start a local Ray)."""
    from workers.rank_worker import RankWorker

    class Local(RankWorker):
        def identity(self) -> dict:
            return {"pid": os.getpid(), "node_id": "local", "actor_id": "local"}

    return Local()


def _recovering_rank(rank: int, ports, full: dict, small: dict, keep: bool, shared: str, results) -> None:
    solo = small.pop("solo")
    from workers.diagnostics.faults import RankStepError

    torch.set_num_threads(1)
    worker = _worker()
    _join(worker, ports, rank, 0, full, rank, 3, keep)
    losses = _steps(worker, 2)
    trainer = worker.trainer
    first = (id(trainer), id(next(trainer.parts.modules[0].parameters())), id(trainer.state.optimizers[0]))
    torch.distributed.barrier()  # every rank's step 2 is done before one of them fails
    if rank == FAILED:  # its connections close: the others' next all-reduce breaks
        worker._leave_group()
        worker = _worker()  # the replacement: a new process in the real group
        if keep:  # it builds alone while the others step, and keeps that trainer at the rejoin
            assert worker.prebuild(solo)
            first = (id(worker.trainer), id(next(worker.trainer.parts.modules[0].parameters())),
                     id(worker.trainer.state.optimizers[0]))
    else:
        try:
            worker.train_step(None, -1)
            raise AssertionError("the step with the failed replica completed")
        except RankStepError:
            pass
        survivors = [r for r in range(3) if r != FAILED]
        _join(worker, ports, rank, 1, small[rank], survivors.index(rank), 2, keep)
        worker.restore_snapshot(2)
        losses += _steps(worker, 2)
        if rank == 0:  # the live peer's snapshot the replacement takes (the controller ships it through Ray)
            torch.save(worker.store.own[4], shared)
    _join(worker, ports, rank, 2, full, rank, 3, keep)
    worker.restore_snapshot(4, torch.load(shared, weights_only=False) if rank == FAILED else None)
    losses += _steps(worker, 2)
    trainer = worker.trainer
    now = (id(trainer), id(next(trainer.parts.modules[0].parameters())), id(trainer.state.optimizers[0]))
    final = io.BytesIO()  # bytes: a tensor put on the queue would be shared memory, gone with this process
    torch.save(worker.kept_snapshot(6), final)
    results.put((rank, {"losses": losses, "final": final.getvalue(), "same_trainer": now == first,
                        "builds": worker.trainer_builds()[0]}))


def _run(token_data, tmp_path, keep: bool) -> dict:
    tmp_path.mkdir()
    spec = tiny_spec(token_data, tmp_path, **SECTIONS)
    small = {**survivor_specs(spec, [0, 1]), "solo": survivor_specs(spec, [FAILED])[FAILED]}
    args = (rank_ports(3), spec.worker_dict(), small, keep, str(tmp_path / "peer_snapshot.pt"))
    out = spawn_ranks(_recovering_rank, args, 3, 300)
    for rank in out.values():
        rank["final"] = torch.load(io.BytesIO(rank["final"]), weights_only=False)
    return out


def test_survivors_keep_their_trainers_and_end_as_rebuilt_ones_do(token_data, tmp_path):
    kept = _run(token_data, tmp_path / "kept", keep=True)
    rebuilt = _run(token_data, tmp_path / "rebuilt", keep=False)
    # the survivors built one trainer and still hold it (model parameters and optimizer the same objects)
    assert [kept[r]["builds"] for r in range(3)] == [1, 1, 1]
    assert kept[0]["same_trainer"] and kept[1]["same_trainer"]
    assert kept[FAILED]["same_trainer"]  # the replacement's trainer is the one it built alone
    assert [rebuilt[r]["builds"] for r in range(3)] == [3, 3, 1]
    assert not rebuilt[0]["same_trainer"] and not rebuilt[1]["same_trainer"]
    # the same training, bit for bit: the losses of every step and every rank's final state
    for rank in range(3):
        assert kept[rank]["losses"] == rebuilt[rank]["losses"]
        assert same_state(kept[rank]["final"], rebuilt[rank]["final"])
    assert same_state(kept[0]["final"], kept[2]["final"]) and same_state(kept[0]["final"], kept[1]["final"])
