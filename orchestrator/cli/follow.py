"""``raymesh run`` and ``raymesh attach``: start or find a job's hosted controller and follow it in the terminal.

The controller is a detached actor (``orchestrator.runtime.hosted``); this process only shows its event lines
and a progress bar, and writes ``--summary-json`` at the end. Killing it leaves the run training. Ctrl-C (or
SIGTERM, which ``ray job stop`` sends) under ``raymesh run`` asks the controller to stop after the current step,
checkpointing when checkpoints are on, and prints the exact ``--resume`` command; a second one detaches at
once. Under ``raymesh attach`` Ctrl-C only detaches: the run goes on.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from orchestrator.errors import SpecError
from orchestrator.events import parse_event
from orchestrator.observability.observers import ProgressBar, StepReport

LOST_CONTROLLER_WAIT_S = 300.0  # how long a follower waits for a lost controller Ray cannot say the state of


class Interrupts:
    """Counts SIGINT/SIGTERM while installed (main thread only) instead of raising ``KeyboardInterrupt``.

    Before there is a controller to stop (``armed`` False), a second one interrupts start-up as usual.
    """

    def __init__(self) -> None:
        self.count = 0
        self.armed = False
        self._before: dict[int, object] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._before[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1 and not self.armed:
            raise KeyboardInterrupt


def resume_command(args: argparse.Namespace) -> str:
    """The ``raymesh run`` command line that continues this run from its newest checkpoint."""
    argv = ["raymesh", "run", args.job]
    for override in args.set:
        argv += ["--set", override]
    if args.address:
        argv += ["--address", args.address]
    return shlex.join([*argv, "--resume"])


def shows_progress(args: argparse.Namespace) -> bool:
    """A progress bar only where a terminal shows it (stderr, where tqdm draws): in a log file, a CI job or a
    ``ray job submit``'s stream each redraw becomes a line of its own and the figures are hard to read back, so
    there the ``event=step`` lines stand in for it, as with ``--no-progress``."""
    return not args.no_progress and sys.stderr.isatty()


def _shown(line: str, keep_summary: bool, progress: bool = False) -> bool:
    """Whether a feed line goes to the terminal: all but the one-line summary JSON (kilobytes of losses), which
    only a submitted job prints, because ``raymesh status|summary`` read it from the job server's log; a terminal
    gets the short summary ``report`` prints and the run dir's ``summary.json``. With a progress bar, no ``step``
    lines either: the bar shows the same figures."""
    parsed = parse_event(line)
    if parsed is not None and parsed[0] == "step":
        return not progress
    return keep_summary or parsed is None or parsed[0] != "summary"


class _Terminal:
    """Shows feed items: event lines on stderr (as the controller logs them, above the progress bar, never into
    its line), steps on a progress bar."""

    def __init__(self, progress: bool, keep_summary: bool = False):
        self.progress, self.keep_summary = progress, keep_summary
        self.bar: ProgressBar | None = None

    def show(self, item: dict, total_steps: int) -> None:
        if "line" in item:
            if _shown(item["line"], self.keep_summary, self.progress):
                tqdm.write(item["line"], file=sys.stderr)
                sys.stderr.flush()
        elif not self.progress:
            return
        elif "step" in item:
            if self.bar is None:
                self.bar = ProgressBar(total_steps, item["step"] - 1)
            self.bar.on_step(StepReport(record=item, mfu=0.0, bubble=0.0, goodput=0.0))
        elif "rollback" in item and self.bar is not None:
            self.bar.on_rollback(item["rollback"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.on_finish()
            self.bar = None


def follow(job, progress: bool, interrupts: Interrupts | None = None, stop_on_interrupt: bool = True) -> dict | None:
    """Show the job until it ends and return its outcome; None when detached by an interrupt.

    A lost controller (its process died) is waited for while Ray restarts it: the new one resumes from the newest
    checkpoint and its feed starts again, and so does the progress bar. Once Ray reports it ``DEAD`` (it gave up
    restarting it, or it was killed for good) the follower stops waiting at once and the run's outcome is what its
    run dir holds (``hosted.lost_for_good``: a summary with status failed, written now).
    """
    from ray.exceptions import GetTimeoutError, RayActorError

    from orchestrator.runtime.hosted import submission_id

    terminal = _Terminal(progress, keep_summary=submission_id() is not None)
    cursor, incarnation, stop_asked, lost_since = 0, "", False, None
    try:
        while True:
            if interrupts is not None and interrupts.count:
                if interrupts.count > 1 or not stop_on_interrupt:
                    return None
                if not stop_asked:
                    stop_asked = _ask_stop(job)
            try:
                reply = job.poll(cursor, incarnation, 0.5)
            except (RayActorError, GetTimeoutError):
                state, why = job.actor_state()
                if state == "DEAD":  # Ray will not restart it: waiting longer would show nothing more
                    return _lost_for_good(job, why)
                lost_since = _wait_for_restart(job, lost_since)
                continue
            lost_since = None
            if reply["incarnation"] != incarnation:  # first reply, or a restarted controller: its feed from 0
                terminal.close()
                incarnation = reply["incarnation"]
                job.remember_spec()
            for item in reply["items"]:
                terminal.show(item, reply["total_steps"])
            cursor = reply["cursor"]
            if reply["outcome"] is not None:
                return reply["outcome"]
    finally:
        terminal.close()


def _ask_stop(job) -> bool:
    """Ask for a graceful stop; False when the controller could not take it now (asked again next round)."""
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        state = job.stop("interrupted (Ctrl-C or SIGTERM)")["state"]
    except (RayActorError, GetTimeoutError, ConnectionError):
        return False
    print(f"raymesh: stopping job {job.job_id} after the current step ({state}); press Ctrl-C again to detach "
          "and leave it training", file=sys.stderr, flush=True)
    return True


def _lost_for_good(job, why: str) -> dict:
    """The outcome of a run whose controller Ray reports dead; without its job (the follower never reached it)
    only the error."""
    from orchestrator.runtime.hosted import lost_for_good

    print(f"raymesh: the controller of job {job.job_id} is gone for good ({why})", file=sys.stderr, flush=True)
    if job.spec is None:
        return {"error": f"the controller of job {job.job_id} is gone and Ray will not restart it ({why})",
                "user_error": False}
    return lost_for_good(job.spec, job.job_id, why)


def _wait_for_restart(job, lost_since: float | None) -> float:
    if lost_since is None:
        print(f"raymesh: the controller of job {job.job_id} was lost; waiting for Ray to restart it (it resumes "
              "from the newest checkpoint)", file=sys.stderr, flush=True)
        lost_since = time.monotonic()
    if time.monotonic() - lost_since > LOST_CONTROLLER_WAIT_S:
        raise ConnectionError(f"the controller of job {job.job_id} is gone and was not restarted within "
                              f"{LOST_CONTROLLER_WAIT_S:g}s; the run dir holds its records and checkpoints: "
                              "continue with `raymesh run JOB --resume`")
    time.sleep(1.0)
    return lost_since


def report(outcome: dict | None, job_id: str, summary_json: str | None, resume: str | None) -> int:
    """Print how the run ended (and write ``summary_json``); the exit status."""
    if outcome is None:
        print(f"raymesh: detached from job {job_id}; it goes on training. Follow it with `raymesh attach {job_id}`, "
              f"end it with `raymesh stop {job_id}`", file=sys.stderr)
        return 130
    if "complete" in outcome:
        print(f"raymesh: {outcome['complete']}")
        return 0
    if summary_json and "summary" in outcome:  # a run whose controller was lost for good has one too
        Path(summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_json).write_text(json.dumps(outcome["summary"], indent=2))
    if "error" in outcome:
        print(f"raymesh: error: job {job_id}: {outcome['error']}", file=sys.stderr)
        return 2 if outcome["user_error"] else 1
    summary = outcome["summary"]
    loss = f"final loss {summary['final_loss']:.4f}" if summary["final_loss"] is not None else "no step trained"
    held = summary.get("eval_losses")  # older summaries (a controller of an earlier version) have none
    if held:
        loss += f", held-out loss {held[-1]['loss']:.4f} (step {held[-1]['step']})"
    print(f"done: {summary['steps']} steps, {loss}, {summary['tokens_per_s']:,.0f} tokens/s")
    for line in _where(summary, summary_json):
        print(f"  {line}")
    failure = summary.get("checkpoint_failure")  # older summaries have none
    if failure:
        print(f"raymesh: error: job {job_id} failed: {_not_kept(failure)}", file=sys.stderr)
        if resume is not None and failure["last_checkpoint"]:
            print(f"free space (or fix the cause) and continue from the newest checkpoint with:\n  {resume}",
                  file=sys.stderr)
        elif resume is not None:  # a --resume would find nothing to resume from
            print("free space (or fix the cause) and run the job again: there is no checkpoint to resume from",
                  file=sys.stderr)
        return 1
    if summary["status"] == "stopped" and resume is not None:
        print(_stopped(summary, resume))
    return 0


def _stopped(summary: dict, resume: str) -> str:
    """Where a stopped run continues from: its last checkpoint, else the one it resumed from; with neither (no
    checkpoints, ``checkpoint.every: 0``) a ``--resume`` would be refused, so it says to run the job again."""
    saved = summary["checkpoints"][-1] if summary["checkpoints"] else summary.get("resumed_from")
    if saved is None:
        return (f"stopped at step {summary['steps']} with no checkpoint (checkpoint.every is 0): there is nothing to "
                "resume from; run the job again to start over")
    which = "checkpoint" if summary["checkpoints"] else "no checkpoint of its steps; a resume continues from"
    return f"stopped at step {summary['steps']} ({which} {saved}); resume with:\n  {resume}"


def _not_kept(failure: dict) -> str:
    """A failed last save (the summary's ``checkpoint_failure``) as a sentence: the cause, the steps not on disk
    and the newest checkpoint that is."""
    newest = (f"the newest checkpoint on disk is step {failure['last_on_disk']} ({failure['last_checkpoint']})"
              if failure["last_checkpoint"] else "no checkpoint of it is on disk")
    return (f"the checkpoint of its last step, {failure['step']}, could not be saved ({failure['reason']}); "
            f"steps {failure['steps_not_kept']} are not kept: {newest}")


def _where(summary: dict, summary_json: str | None) -> list[str]:
    """Where the run's outputs are: the summary JSON, the report command, the newest and best checkpoints."""
    lines = []
    run_dir = summary.get("run_dir")
    if run_dir:
        lines.append(f"summary: {run_dir.rstrip('/')}/summary.json")  # a URL too (Path would fold its //)
    if summary_json:
        lines.append(f"summary copy: {summary_json}")
    if run_dir:
        lines.append(f"report: raymesh report {shlex.quote(run_dir)}")
    failure = summary.get("checkpoint_failure")
    if failure:  # ``checkpoints`` lists this run's saves: the last may not be the newest on disk, nor the last step
        lines.append(f"newest checkpoint: {failure['last_checkpoint'] or 'none'} "
                     f"(steps {failure['steps_not_kept']} not kept)")
    elif summary["checkpoints"]:
        lines.append(f"newest checkpoint: {summary['checkpoints'][-1]}")
    best = summary.get("best_checkpoint")  # older summaries have none
    if best:
        lines.append(f"best checkpoint (held-out loss {best['eval_loss']:.4f}): {best['path']}")
    return lines


def check_summary_json(path: str | None) -> None:
    """``--summary-json`` can be written (as a file, its missing folders made): checked before anything starts,
    because it is written only when the run ends, where a directory or a read-only folder there would be reported
    after the whole run had trained."""
    if path is None:
        return
    from orchestrator.spec.runtime_checks import unwritable_ancestor

    target = Path(path)
    if target.is_dir():
        raise SpecError("--summary-json", path, "is a directory", f"give a file path, e.g. {target / 'summary.json'}")
    folder = unwritable_ancestor(target.absolute().parent)
    if folder is not None:
        raise SpecError("--summary-json", path, f"cannot be written: {folder} is not a writable directory",
                        "give a file path in a directory you can write")


def run(args: argparse.Namespace) -> int:
    """``raymesh run``: check the job here, start its detached controller, follow it to the end."""
    from orchestrator.checkpoints.dir_lock import check_free
    from orchestrator.checkpoints.job_record import check_resume
    from orchestrator.checkpoints.start_checks import refuse_start
    from orchestrator.cli.default_corpus import prepare_default_corpus
    from orchestrator.runtime import cluster
    from orchestrator.runtime.controller import RunComplete, refuse_if_complete
    from orchestrator.runtime.hosted import AlreadyRunning, HostedJob, job_id_for
    from orchestrator.runtime.ray_runtime import RayRuntime
    from orchestrator.spec import load_spec

    spec = load_spec(args.job, args.set)
    check_summary_json(args.summary_json)
    check_free(spec)  # another run in this run dir: refused at once, naming it (before what its saves left)
    prepare_default_corpus(spec)
    try:
        if args.resume:
            refuse_if_complete(spec)
            check_resume(spec)  # a job file that reads the checkpoint otherwise: refused before Ray starts
    except RunComplete as done:
        return report({"complete": str(done)}, "", None, None)
    refuse_start(spec, args.resume)  # a fresh run beside checkpoints, a resume with none: before Ray starts
    RayRuntime().preflight(spec)  # bad data or disk fails here, before Ray starts
    with Interrupts() as interrupts:
        cluster.connect(args.address, spec.parallel.world_size * spec.parallel.cpus_per_rank)
        job_id = args.id or job_id_for(spec)
        try:
            job = HostedJob.start(_hosted_spec(spec), args.resume, job_id)
        except AlreadyRunning as exc:
            print(f"raymesh: error: {exc}", file=sys.stderr)
            return 2
        interrupts.armed = True
        print(f"raymesh: job {job_id} runs in a detached controller: `raymesh attach {job_id}` follows it again, "
              f"`raymesh stop {job_id}` ends it", file=sys.stderr, flush=True)
        outcome = follow(job, shows_progress(args), interrupts)
    if outcome is not None:
        job.release()
    return report(outcome, job_id, args.summary_json, resume_command(args))


def attach(args: argparse.Namespace) -> int:
    """``raymesh attach ID``: follow a hosted job to its end (Ctrl-C detaches, the job goes on)."""
    from orchestrator.runtime.hosted import HostedJob, join_cluster

    check_summary_json(args.summary_json)
    join_cluster(args.ray_address)  # an unreachable cluster is said as such, not as "no running controller"
    job = HostedJob.find(args.id, args.ray_address)
    if job is None:
        raise LookupError(f"no running raymesh controller for job {args.id!r} on the Ray cluster at "
                          f"{args.ray_address or 'RAY_ADDRESS (or the local one)'}; an ended run's records are in "
                          "its run dir (`raymesh report RUN_DIR`)")
    with Interrupts() as interrupts:
        interrupts.armed = True
        outcome = follow(job, shows_progress(args), interrupts, stop_on_interrupt=False)
    if outcome is not None:
        job.release()
    return report(outcome, args.id, args.summary_json, None)


def _hosted_spec(spec) -> dict:
    """The spec as the actor gets it: its run dir absolute (or its URL), since the actor's working directory is
    not ours."""
    raw = spec.to_dict()
    raw["run_dir"] = spec.run_dir_url() or str(spec.resolved_run_dir().resolve())
    return raw
