"""``RankWorker``: the Ray actor that hosts one rank's ``Trainer``.

The class is plain Python; the orchestrator turns it into an actor with
``ray.remote`` and its placement options, so this package never depends on the
controller.

Replicas of peers' snapshots arrive on a separate concurrency group
(``replicas``) so a holder stores them while its own step runs. The rank runs its
own loop of steps (``run_window``, ``workers.loop``); rank 0's desk answers the
controller on another (``control``) while the loop runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import traceback

import ray

from workers.diagnostics import stacks
from workers.group_sockets import GroupSockets
from workers.loop.desk import DeskHolder
from workers.loop.plan import Window, WindowEnd
from workers.protocol import RankInfo, StepResult


def _remove_orphaned_offload(spec: dict) -> None:
    """A dead rank's NVMe offload files on this node (its SIGKILL skipped their clean-up), with a log line."""
    offload = spec.get("memory", {}).get("offload", {})
    if offload.get("tier") != "nvme":
        return
    from workers.offload.store import remove_orphans

    for path in remove_orphans(offload.get("path")):
        print(f"raymesh event=offload_orphan_removed path={path} why=its rank's process is gone", flush=True)


class RankWorker(DeskHolder):
    def __init__(self) -> None:
        # Ray sets OMP_NUM_THREADS to the actor's whole CPUs (at least 1) unless the environment has it already;
        # torch is first imported after this, in ``preload``
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        stacks.install()  # its node's agent can read every thread's stack, even when this process is stuck
        self.notice = threading.Event()  # a preemption notice (SIGTERM) came: save the step, then go
        if threading.current_thread() is threading.main_thread():  # Ray creates an actor on its main thread
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self.trainer = None
        self.builds = 0  # trainers this process built (a keep_training survivor keeps its own: ``setup``)
        self.prebuilt = False  # a keep_training replacement built its trainer alone before the rejoin (``prebuild``)
        self.kept = False  # the last ``setup`` kept the trainer: ``restore_snapshot`` copies only what it must
        self.store = None  # this rank's SnapshotStore, from setup on
        self.sockets = GroupSockets()  # the connections of this rank's process groups, shut when a step fails
        self._listener: socket.socket | None = None  # the store's socket between rendezvous_address and setup
        self.exchange = None  # this rank's side of the step boundary's exchange tree (workers.loop.tree)
        self._init_desk()  # rank 0's desk for the window running (a new one per window id)

    def _on_sigterm(self, signum, frame) -> None:
        """A spot reclaim or a Kubernetes eviction: instead of exiting at once (Ray's own handler), this rank's
        loop reports the notice with its next step; rank 0 ends the window there with a checkpoint of that step
        every rank writes, and the controller then replaces this rank with nothing lost (``RankLoop._decide``).
        The platform's SIGKILL after its grace period ends the process if the controller has not by then."""
        self.notice.set()
        print(f"raymesh preemption notice: pid {os.getpid()} saves its step, then goes", flush=True)

    def rendezvous_address(self, local_only: bool = False) -> tuple[str, int]:
        """An address and port for this rank (rank 0) to serve the process-group store on, already bound.

        ``local_only`` (every rank on this node): loopback, so the unauthenticated store is not reachable from
        other hosts; otherwise this node's cluster IP, not every interface. The socket stays open until
        ``setup`` hands it to the store, so no other process can take the port in between.
        """
        from workers.parallel.process_group import listen_on

        if self._listener is not None:
            self._listener.close()
        self._listener = listen_on("127.0.0.1" if local_only else ray.util.get_node_ip_address())
        host, port = self._listener.getsockname()[:2]
        return host, port

    def identity(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "actor_id": ctx.get_actor_id()}

    def preload(self) -> None:
        """Import torch and the trainer before the rendezvous: a fresh process takes seconds to import on a
        loaded host, and its peers would spend them waiting in the store, against the collective timeout."""
        import workers.trainer  # noqa: F401

    def prebuild(self, spec: dict) -> bool:
        """``recovery: keep_training``: build this replacement's trainer now, alone (a process group of one, on
        loopback), while the other replicas step on; returns whether it did.

        Why: the rejoin stops every replica, and a replacement that built its model and optimizer only then kept
        them all waiting about a second for it. Built here, the rejoin's ``setup`` moves it to the full group as a
        survivor's trainer moves (``Trainer.regroup``: a rendezvous, not a build), and ``restore_snapshot`` then
        gives it a live peer's state. ``spec`` is the job at one replica reading this rank's data slot
        (``keep_training.survivor_specs`` of this rank alone). A failure here is logged and the rank builds at the
        rejoin as before.
        """
        try:
            addr, port = self.rendezvous_address(local_only=True)
            self.setup(spec, 0, 1, addr, port)
        except Exception as exc:  # the rejoin builds it instead; the reason goes to the log
            print(f"raymesh event=prebuild_failed why={exc!r} action=the rank builds its trainer at the rejoin",
                  flush=True)
            self.trainer = None
            return False
        finally:
            self.store = None  # made under the rank's grid rank by the rejoin's ``setup``
        self.prebuilt = True
        return True

    def setup(self, spec: dict, rank: int, world_size: int, master_addr: str, master_port: int,
              keep_trainer: bool = False) -> RankInfo:
        """Join the process group and build this rank's model; after a peer failed, do it again in place.

        A survivor keeps its process (Python and its imports): only the broken process group
        and the objects bound to it are rebuilt. With ``keep_trainer`` (``recovery: keep_training``, plain data
        parallelism) it keeps its whole trainer too, model and optimizer included (``Trainer.regroup``); a rank
        with none yet (a replacement) or one that cannot move (said in a log line) builds one. Returns the rank's
        place, device and identity.
        """
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        old_ps = getattr(self.trainer, "ps", None)
        carried = old_ps.feedback_to_carry() if old_ps is not None else None
        kept = self.trainer if keep_trainer else None
        if dist.is_initialized():
            self.trainer = None
            dist.destroy_process_group()
        _remove_orphaned_offload(spec)
        listener, self._listener = self._listener, None
        self.kept = kept is not None and self._kept(kept, spec, rank)
        build = (lambda: self._regroup(kept, spec, rank, world_size, master_addr, master_port, listener)) \
            if self.kept else (lambda: self._build(spec, rank, world_size, master_addr, master_port, listener))
        self.trainer, self.exchange = self.sockets.record(build)
        self.builds += not self.kept
        if self.trainer.ps is not None:
            self.trainer.ps.carry_over(carried)
        if self.store is None:  # a survivor keeps its snapshots and the replicas it holds
            from workers.state.snapshot_store import SnapshotStore

            self.store = SnapshotStore(rank)
        t = self.trainer
        name = torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else "cpu"
        return RankInfo(rank=rank, coords=t.grid.coords_dict(rank), stages=t.parts.stage_ids, device=str(t.device),
                        device_name=name, **self.identity())

    @staticmethod
    def _kept(trainer, spec: dict, rank: int) -> bool:
        """Whether ``trainer`` can move to the group of ``spec`` (``Trainer.regroup_refused``); a log line says why
        not, and the rank is built anew as under any other recovery."""
        from workers.spec import WorkerSpec

        why = trainer.regroup_refused(WorkerSpec.from_dict(spec), rank)
        if why:
            print(f"raymesh event=trainer_rebuilt rank={rank} why={why!r}", flush=True)
        return not why

    @staticmethod
    def _regroup(trainer, spec: dict, rank: int, world_size: int, master_addr: str, master_port: int, listener):
        """``trainer`` moved to the new group, and the exchange tree on a gloo group made where ``_build`` makes
        it (after the mesh, the same order on every rank, kept trainer or new)."""
        trainer.regroup(spec, rank, world_size, master_addr, master_port, listener)
        return trainer, RankWorker._exchange(rank, world_size)

    @staticmethod
    def _build(spec: dict, rank: int, world_size: int, master_addr: str, master_port: int, listener):
        """The trainer (it joins the mesh) and the exchange tree its loop reports through, on a gloo group of
        every rank made in the same order on all of them."""
        from workers.trainer import Trainer

        trainer = Trainer(spec, rank, world_size, master_addr, master_port, listener=listener)
        return trainer, RankWorker._exchange(rank, world_size)

    @staticmethod
    def _exchange(rank: int, world_size: int):
        """This rank's side of the step boundary's exchange tree, on a gloo group of every rank."""
        import torch.distributed as dist

        from workers.loop.torch_transport import TorchTransport
        from workers.loop.tree import LocalTransport, TreeExchange

        transport = TorchTransport(dist.new_group(backend="gloo")) if world_size > 1 else LocalTransport()
        return TreeExchange(rank, world_size, transport)

    def run_window(self, window: Window, window_id: int) -> WindowEnd:
        """Run steps on this rank's own (``workers.loop.RankLoop``) until the window ends; rank 0 hands the
        controller the records through its desk. A step, save or exchange that raises is ``RankStepError``, as a
        failed step always was, and this rank leaves its groups so its peers stop waiting for it."""
        from workers.diagnostics.faults import RankStepError
        from workers.loop.loop import RankLoop
        from workers.loop.trainer_stepper import TrainerStepper

        stepper = TrainerStepper(self.trainer, self.store, self._take_snapshot, self.notice.is_set)
        loop = RankLoop(stepper, self.exchange, self._desk_of(window_id) if self.exchange.root else None)
        self._loop, self._loop_thread = loop, threading.get_ident()
        try:
            return loop.run(window)
        except Exception as exc:
            error = RankStepError.of(exc)
            self._leave_group()
            raise error from None

    @ray.method(concurrency_group="control")
    def progress(self) -> dict:
        """Where this rank's loop is (``RankLoop.progress``) and the innermost frames of its thread: what the
        controller reads of every rank when no step has completed within the deadline, to find the stuck one."""
        loop = getattr(self, "_loop", None)
        out = loop.progress() if loop is not None else {"phase": "idle", "step": 0, "for_s": 0.0}
        frame = sys._current_frames().get(getattr(self, "_loop_thread", None))
        out["where"] = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                        for f in traceback.extract_stack(frame)[-3:]] if frame is not None else []
        return out

    @ray.method(concurrency_group="control")
    def flight_record(self) -> bytes | None:
        """On NCCL with torch's flight recorder on (``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0): its trace of this rank's
        recent collectives (pickled, as ``torch._C._distributed_c10d._dump_nccl_trace`` gives it), which says the
        collective each rank is in when the job hangs; None elsewhere (CPU, gloo, the recorder off)."""
        if self.trainer is None or self.trainer.device.type != "cuda":
            return None
        if int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") or 0) <= 0:
            return None
        import torch

        dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
        return dump() if dump is not None else None

    def train_step(self, fault: dict | None = None, snapshot_keep_from: int | None = None) -> StepResult:
        """One step; with ``snapshot_keep_from`` set, then snapshot it (its replica ships in the background).

        A step that raises (a collective broken by a dead peer, out of memory, any other error) raises
        ``RankStepError`` saying which, so the controller replaces a rank that failed on its own and keeps
        one whose collective only broke with a dead peer.
        """
        from workers.diagnostics.faults import RankStepError

        try:
            result = self.trainer.train_step(fault)
        except Exception as exc:
            error = RankStepError.of(exc)
            self._leave_group()
            raise error from None
        if snapshot_keep_from is not None:
            self._take_snapshot(snapshot_keep_from)
        return dataclasses.replace(result, replicated_step=self.store.replicated)

    def _leave_group(self) -> None:
        """After a failed step, shut this rank's gloo connections: peers still blocked on it fail at once and do the
        same, instead of waiting out the collective timeout (``workers.group_sockets``). The group is rebuilt by
        the next ``setup``. Not on NCCL, whose sockets are not known to unblock its kernels this way."""
        if self.trainer.device.type == "cpu":
            self.sockets.leave()

    def ps_reroute(self, shard: int, route: dict) -> None:
        """A parameter-server shard was restarted and resynced: send its keys there again."""
        self.trainer.ps.reroute(shard, route)

    def ps_reshard(self, routes: list[dict]) -> None:
        """The parameter server was resized between steps (chunks moved): push and pull on the new ring."""
        self.trainer.ps.reshard(routes)

    def ps_resume(self, step: int | None = None) -> int:
        """The shards were restored to this rank's step (resume, rollback): push and pull from its clock there;
        ``step``: the controller's, for a rank rebuilt at step 0 that rejoins asp/ssp training (``PSSync.rejoin``)."""
        return self.trainer.ps.resume_at(self.trainer.step if step is None else step)

    def ps_feedback_chunks(self) -> int:
        """How many chunk keys of top-k error feedback this rank's worker holds (reported when asp/ssp workers
        rejoin: a replacement starts with none, its predecessor's went with its process)."""
        return len(self.trainer.ps.codec.errors)

    def set_holder(self, holder) -> None:
        """The actor that keeps this rank's replicas from now on (set at every (re)formation)."""
        self.store.holder = holder

    def take_snapshot(self, keep_from: int = -1) -> int:
        self._take_snapshot(keep_from)
        return self.trainer.step

    def _take_snapshot(self, keep_from: int) -> None:
        from workers.state import snapshot

        compress = self.trainer.spec.fault_tolerance.snapshot_compression == "zlib"
        self.store.keep(self.trainer.step, snapshot.take(self.trainer.state, compress), keep_from)

    def snapshot_steps(self) -> dict:
        """The steps this rank can restore and the replicas it holds, once no replica is in flight."""
        return self.store.settle() if self.store is not None else {"own": [], "replicas": {}}

    def kept_snapshot(self, step: int) -> dict:
        """This rank's snapshot of ``step``, for the rank of another grid that takes over its position."""
        return self.store.own[step]

    @ray.method(concurrency_group="replicas")
    def hold_replica(self, rank: int, step: int, snap: dict) -> None:
        self.store.hold(rank, step, snap)

    def replica(self, rank: int, step: int) -> dict:
        return self.store.replicas[rank][step]

    def restore_snapshot(self, step: int, snap: dict | None = None) -> int:
        """Roll back to ``step``: to ``snap`` (a replica handed over for a replaced rank) or this rank's own. A
        trainer kept through ``setup`` copies only what a step begun since ``step`` changed (``_roll_back_kept``)."""
        from workers.state import snapshot

        kept, self.kept = self.kept, False
        if snap is None and kept:
            self._roll_back_kept(step)
        else:
            snapshot.restore(self.trainer.state, snap if snap is not None else self.store.own[step])
        self.trainer.at_boundary()
        self.store.roll_back(step)
        if snap is not None:
            self.store.own[step] = snap
        return self.trainer.step

    def _roll_back_kept(self, step: int) -> None:
        """A kept trainer back to its own snapshot of ``step``, as a rebuilt one restoring it would end.

        At that step with no step begun since (the window ended at the boundary, as at a rejoin): nothing to copy.
        A step begun and failed before any optimizer stepped (a survivor whose all-reduce broke with the dead
        peer): the weights and optimizer state are the snapshot's still; the data cursor, the LR schedule, the loss
        scale and the buffers a forward may move are put back (``regroup`` dropped the gradients). Anything
        else (an update ran, or the rank is past ``step``): the whole snapshot, as ever."""
        from workers.state import snapshot

        t = self.trainer
        if t.step != step or t.weights_moved:
            snapshot.restore(t.state, self.store.own[step])
        elif t.mid_step:
            snapshot.restore_progress(t.state, self.store.own[step])

    def skip_batch(self) -> None:
        """Pass over the next batch without training on it (its step was NaN again and again)."""
        self.trainer.state.cursor.next_batch()

    def save_checkpoint(self, path: str, async_save: bool) -> None:
        ps = self.trainer.ps  # asp/ssp train on their own thread: save between two of its steps
        with ps.quiet if ps is not None else contextlib.nullcontext():
            self.trainer.checkpoints.save(path, async_save)

    def wait_checkpoint(self) -> int | None:
        return self.trainer.checkpoints.wait()

    def checkpoint_durable(self) -> bool:
        return self.trainer.checkpoints.durable()

    def trainer_builds(self) -> tuple[int, bool]:
        """How many trainers this process built, and whether it built one alone before joining (tests: a
        ``keep_training`` survivor builds one only; a replacement builds its one before the rejoin)."""
        return self.builds, self.prebuilt

    def load_checkpoint(self, path: str) -> int:
        self.trainer.checkpoints.load(path)
        self.trainer.at_boundary()
        self.kept = False
        if self.store is not None:
            self.store.roll_back(self.trainer.step)
        return self.trainer.step

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.trainer is not None:
            self.trainer.checkpoints.wait()
            self.trainer.close_stores()
        if dist.is_initialized():
            dist.destroy_process_group()
