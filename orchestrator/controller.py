"""``TrainingJob``: turns a validated spec into a running rank grid and drives it.

The controller runs in the driver process (the ``raymesh run`` process, or the
entrypoint of a ``ray job submit``): it reserves placement, starts one
``RankWorker`` actor per rank, forms the process group, then runs the step loop,
checkpoint cadence and bookkeeping, and returns the ``RunResult``.
"""

from __future__ import annotations

import statistics
import time

import ray
from tqdm import tqdm

from orchestrator import cluster
from orchestrator.checkpoints import CheckpointDir
from orchestrator.events import event
from orchestrator.placement import RankPlacement, reserve
from orchestrator.run_result import RunResult
from orchestrator.spec import JobSpec, check_data_path, check_resources
from workers.rank_worker import RankWorker


class TrainingJob:
    def __init__(self, spec: JobSpec, resume: bool = False, address: str | None = None, progress: bool = True):
        self.spec = spec
        self.resume = resume
        self.address = address
        self.progress = progress
        self.run_dir = spec.resolved_run_dir()
        self.ckpt = CheckpointDir(spec.checkpoint.resolved_dir(self.run_dir), spec.checkpoint.keep)
        self.workers: list = []
        self.placement: RankPlacement | None = None

    # -- start-up ------------------------------------------------------------------------

    def _use_gpu(self, gpus: float) -> bool:
        device = self.spec.parallel.device
        return device == "cuda" or (device == "auto" and gpus > 0)

    def _start(self) -> dict:
        p = self.spec.parallel
        check_data_path(self.spec)
        cluster.connect(self.address, p.world_size * p.cpus_per_rank)
        cpus, gpus = cluster.available()
        use_gpu = self._use_gpu(gpus)
        check_resources(self.spec, cpus, gpus, "cuda" if use_gpu else "cpu")
        self.placement = reserve(self.spec, use_gpu)
        actor = ray.remote(RankWorker)
        self.workers = [
            actor.options(
                num_cpus=p.cpus_per_rank,
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=self.placement.strategy(rank),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
                name=f"{self.spec.name}-rank{rank}-{time.time_ns()}",
            ).remote()
            for rank in range(p.world_size)
        ]
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        worker_spec = self.spec.worker_dict()
        infos = ray.get(
            [w.setup.remote(worker_spec, r, p.world_size, addr, port) for r, w in enumerate(self.workers)]
        )
        identities = ray.get([w.identity.remote() for w in self.workers])
        for info, ident in zip(infos, identities):
            info["node_id"] = ident["node_id"]
        return {
            "dp": p.dp, "pp": p.pp, "tp": p.tp, "zero": p.zero, "pp_schedule": p.pp_schedule,
            "virtual_stages": p.stages_per_rank, "world_size": p.world_size, "ranks": infos,
        }

    def _stop(self) -> None:
        if self.workers:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
            except Exception:  # a rank that already died cannot shut down cleanly; it is killed below
                pass
            for w in self.workers:
                ray.kill(w)
            self.workers = []
        if self.placement is not None:
            self.placement.release()
            self.placement = None

    # -- checkpoints ---------------------------------------------------------------------

    def _save(self, step: int, saved: list[str]) -> None:
        if self.spec.checkpoint.async_save:
            self._wait_async(saved)  # at most one save in flight; commit the previous one first
        path = self.ckpt.path_for(step)
        t0 = time.perf_counter()
        ray.get([w.save_checkpoint.remote(str(path), self.spec.checkpoint.async_save) for w in self.workers])
        if not self.spec.checkpoint.async_save:
            self._committed(step, saved, time.perf_counter() - t0)

    def _wait_async(self, saved: list[str]) -> None:
        done = ray.get([w.wait_checkpoint.remote() for w in self.workers])
        if done[0] is not None:
            self._committed(done[0], saved, None)

    def _committed(self, step: int, saved: list[str], seconds: float | None) -> None:
        saved.append(str(self.ckpt.path_for(step)))
        removed = self.ckpt.prune()
        event("checkpoint", step=step, path=self.ckpt.path_for(step),
              seconds="async" if seconds is None else f"{seconds:.2f}", pruned=removed or "-")

    # -- the run -------------------------------------------------------------------------

    def run(self) -> RunResult:
        spec = self.spec
        t_start = time.perf_counter()
        event("start", job=spec.name, world_size=spec.parallel.world_size, run_dir=self.run_dir)
        try:
            layout = self._start()
            event("layout", dp=layout["dp"], pp=layout["pp"], tp=layout["tp"], zero=layout["zero"],
                  schedule=layout["pp_schedule"], devices=layout["ranks"][0]["device"])
            resumed_from = self._maybe_resume()
            startup_s = time.perf_counter() - t_start
            result = self._loop(layout, startup_s, resumed_from)
        finally:
            self._stop()
        event("finish", job=spec.name, steps=result.steps, final_loss=result.final_loss,
              tokens_per_s=f"{result.tokens_per_s:.0f}")
        return result

    def _maybe_resume(self) -> str | None:
        if not self.resume:
            return None
        latest = self.ckpt.latest()
        if latest is None:
            event("resume", found="none", dir=self.ckpt.root, action="starting from step 0")
            return None
        steps = ray.get([w.load_checkpoint.remote(str(latest)) for w in self.workers])
        event("resume", path=latest, step=steps[0])
        return str(latest)

    def _loop(self, layout: dict, startup_s: float, resumed_from: str | None) -> RunResult:
        spec = self.spec
        every = spec.checkpoint.every
        first = self._current_step(resumed_from)
        losses, norms, step_times, saved = [], [], [], []
        peak: dict[int, int] = {}
        tokens = spec.train.global_batch_size * spec.model.seq_len
        bar = tqdm(total=spec.train.steps, initial=first, disable=not self.progress, unit="step", dynamic_ncols=True)
        t_train = time.perf_counter()
        for step in range(first + 1, spec.train.steps + 1):
            t0 = time.perf_counter()
            results = ray.get([w.train_step.remote() for w in self.workers])
            step_times.append(time.perf_counter() - t0)
            step_loss = statistics.fmean(r["loss"] for r in results if r["loss"] is not None)
            losses.append(step_loss)
            norms.append(results[0]["grad_norm"])
            for r in results:
                peak[r["rank"]] = max(peak.get(r["rank"], 0), r["peak_memory_bytes"])
            bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tokens / step_times[-1]:.0f}")
            bar.update(1)
            if every and (step % every == 0 or step == spec.train.steps):
                self._save(step, saved)
        bar.close()
        train_s = time.perf_counter() - t_train
        if every:
            self._wait_async(saved)
        return RunResult(
            steps=spec.train.steps,
            losses=losses,
            final_loss=losses[-1] if losses else None,
            tokens_per_s=tokens * len(losses) / train_s if losses else 0.0,
            layout=layout,
            checkpoints=saved,
            peak_memory_bytes=peak,
            grad_norms=norms,
            startup_s=startup_s,
            step_time_s=step_times,
            resumed_from=resumed_from,
        )

    def _current_step(self, resumed_from: str | None) -> int:
        if resumed_from is None:
            return 0
        return int(resumed_from.rsplit("-", 1)[1])
