"""Issue 19 item 4: does the recovery path's abort work on a process group whose peer is killed mid-collective,
and is the survivor still alive to re-form a group? Two processes share device 0 (NCCL on a GPU, gloo on a CPU).

What each process runs is the rank's own recovery code, not a copy of it: it joins with ``init_mesh`` (the
group timeout set as a job's ``collective_timeout_s`` sets it) while ``GroupSockets`` records its connections,
as ``RankWorker.setup`` does; a failed collective becomes ``RankStepError.of`` (``peer_lost`` is what the
controller keeps a survivor for); on gloo the survivor then shuts its connections (``RankWorker._leave_group``);
and it re-forms as ``RankWorker.setup`` does after a failure: ``destroy_process_group`` and ``init_mesh`` again,
here with a replacement process for the killed one, and one all-reduce over the new group.

On a GPU it runs twice: as raymesh runs (``init_mesh`` sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: abort the
communicator and raise, without tearing the process down; ``process_group.keep_survivors_on_nccl_errors``) and
with PyTorch's own default (``3``: tear the process down), so one lease shows whether the default would take
survivors down with the lost rank and whether raymesh's setting keeps them. NCCL may refuse two ranks on one
device ("Duplicate GPU"): the variant then reports that, which is the documented limit the issue allows.
"""

from __future__ import annotations

import os
import queue
import signal
import time

import torch.multiprocessing as mp

from tests.support.ports import GroupPorts

ADDR = "127.0.0.1"
DEFAULT_ENV: dict[str, str] = {}  # raymesh's own: init_mesh sets the NCCL error handling to 2 on a GPU
TORCH_DEFAULT_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}  # PyTorch's default, which raymesh overrides


def _join(rank: int, ports, group: int, device_kind: str, timeout_s: float, sockets=None):
    """Join two-rank group ``group`` (0: first, 1: re-formed) on device 0 the way a rank does; returns the device.
    Rank 0 binds the group's port as it forms and its peer reads it from ``ports`` (``GroupPorts``), so no port
    picked earlier can have been taken meanwhile."""
    from workers.contract.grid import Grid
    from workers.parallel.process_group import init_mesh, pick_device

    os.environ["LOCAL_RANK"] = "0"  # both processes on device 0
    device = pick_device(device_kind)
    port, listener = ports.join(rank, group, timeout_s)
    build = lambda: init_mesh(rank, 2, ADDR, port, Grid(dp=2), device, timeout_s=timeout_s,  # noqa: E731
                              listener=listener)
    if sockets is None:
        build()
    else:
        sockets.record(build)
    return device


def _all_reduce(device) -> float:
    """One all-reduce of a 1 on every rank, waited for (NCCL's returns before the kernel ends).

    A NCCL kernel ended by the watchdog's abort raises nothing itself and leaves a wrong sum: the next
    collective on the aborted communicator is what raises NCCL's error, as the trainer's next one would."""
    import torch
    import torch.distributed as dist

    def once() -> float:
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return float(t.item())

    value = once()
    if value != 2.0:
        value = once()
    if value != 2.0:
        raise RuntimeError(f"all-reduce returned {value}, not 2.0, twice without an error")
    return value


def _survivor(rank: int, ports, device_kind: str, timeout_s: float, events) -> None:
    """Rank 0: form the group, enter a collective the killed peer never joins, then fail, leave and re-form."""
    import torch.distributed as dist

    from workers.diagnostics.faults import RankStepError
    from workers.group_sockets import GroupSockets

    sockets = GroupSockets()
    try:
        device = _join(0, ports, 0, device_kind, timeout_s, sockets)
        events.put(("formed", _all_reduce(device)))
    except Exception as exc:  # NCCL may refuse two ranks on one device
        events.put(("formation_failed", RankStepError.of(exc).detail))
        return
    events.put(("entering", time.monotonic()))
    start = time.monotonic()
    try:
        events.put(("completed", _all_reduce(device)))
        return
    except Exception as exc:
        error = RankStepError.of(exc)
        now = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
        events.put(("failed", {"at": now, "in_collective_s": now - start, "kind": error.kind, "detail": error.detail}))
    if device.type == "cpu":
        sockets.leave()  # RankWorker._leave_group
    dist.destroy_process_group()
    _join(0, ports, 1, device_kind, timeout_s)
    events.put(("reformed", _all_reduce(device)))
    dist.destroy_process_group()


def _peer(rank: int, ports, group: int, device_kind: str, timeout_s: float, events, role: str) -> None:
    """Rank 1: the ``victim`` joins, takes part in the first all-reduce and then waits to be killed; the
    ``replacement`` joins the re-formed group and takes part in its all-reduce."""
    import torch.distributed as dist

    try:
        device = _join(1, ports, group, device_kind, timeout_s)
        value = _all_reduce(device)
    except Exception as exc:
        events.put((f"{role}_failed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
        return
    events.put((f"{role}_reduced", value))
    if role == "victim":
        time.sleep(3600)
    dist.destroy_process_group()


def _spawn(ctx, target, *args):
    proc = ctx.Process(target=target, args=(1, *args), daemon=True)
    proc.start()
    return proc


def _wait_for(events, seen: dict, name: str, deadline: float, survivor) -> bool:
    """Collect events into ``seen`` until ``name`` arrives, a failure ends the run, the survivor process is
    gone (NCCL's error handling may end it) or the deadline passes."""
    while name not in seen and time.monotonic() < deadline:
        try:
            key, value = events.get(timeout=0.2)
        except queue.Empty:
            if not survivor.is_alive():
                return False
            continue
        seen[key] = value
        if key in ("formation_failed", "completed", "victim_failed", "replacement_failed"):
            return False
    return name in seen


def run_variant(device_kind: str, timeout_s: float, env: dict[str, str]) -> dict:
    """One survivor, one victim killed while the survivor is inside a collective with it, one replacement."""
    ctx = mp.get_context("spawn")
    events, ports = ctx.Queue(), GroupPorts(2, ctx)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawn children inherit the environment at start
    seen: dict = {}
    procs = []
    try:
        survivor = ctx.Process(target=_survivor, args=(0, ports, device_kind, timeout_s, events), daemon=True)
        survivor.start()
        victim = _spawn(ctx, _peer, ports, 0, device_kind, timeout_s, events, "victim")
        procs += [survivor, victim]
        deadline = time.monotonic() + 2 * timeout_s + 30
        if _wait_for(events, seen, "entering", deadline, survivor):
            time.sleep(1.0)  # let the survivor's collective start and block on the victim
            os.kill(victim.pid, signal.SIGKILL)
            seen["killed_at"] = time.monotonic()
            procs.append(_spawn(ctx, _peer, ports, 1, device_kind, timeout_s, events, "replacement"))
            _wait_for(events, seen, "reformed", deadline, survivor)
        _wait_for(events, seen, "replacement_reduced", min(deadline, time.monotonic() + 10), survivor)
        survivor.join(timeout=5)
        exit_code = survivor.exitcode
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return outcome(device_kind, env, timeout_s, seen, exit_code)


def outcome(device_kind: str, env: dict[str, str], timeout_s: float, seen: dict, exit_code: int | None) -> dict:
    """The variant's JSON: whether the group formed, the survivor's collective failed in time, how it was
    classified, whether the survivor lived on (exit 0 after re-forming) and the re-formed all-reduce's value."""
    failed = seen.get("failed")
    reformed = seen.get("reformed")
    out = {"backend": "nccl" if device_kind == "cuda" else "gloo", "env": env, "group_timeout_s": timeout_s,
           "group_formed": seen.get("formed") == 2.0, "formation_error": seen.get("formation_failed"),
           "collective_failed": failed is not None,
           "failed_after_kill_s": failed and failed["at"] - seen.get("killed_at", failed["at"]),
           "within_timeout": bool(failed) and failed["at"] - seen.get("killed_at", failed["at"]) <= timeout_s + 5,
           "error_kind": failed and failed["kind"], "error": failed and failed["detail"],
           "survivor_alive": reformed is not None, "survivor_exit_code": exit_code,
           "reformed_all_reduce": reformed, "reformed_ok": reformed == 2.0 and seen.get("replacement_reduced") == 2.0}
    out["summary"] = _summary(out)
    return out


SHARED_DEVICE_REFUSED = ("NCCL refuses two ranks of one group on one GPU (ncclInvalidUsage, 'Duplicate GPU "
                         "detected' under NCCL_DEBUG=WARN): this check needs two GPUs")


def _summary(o: dict) -> str:
    if not o["group_formed"]:
        error = o["formation_error"] or "no answer"
        if o["backend"] == "nccl" and "invalid usage" in error:  # what an H200 answered with NCCL 2.28.9
            return f"group did not form: {SHARED_DEVICE_REFUSED}"
        return f"group did not form: {error}"
    if not o["collective_failed"] and o["survivor_exit_code"] not in (None, 0):
        return f"survivor torn down inside the collective (exit code {o['survivor_exit_code']}), no error raised"
    if not o["collective_failed"]:
        return "the survivor's collective never failed (no error before the deadline)"
    alive = "survivor re-formed the group with a replacement" if o["reformed_ok"] else (
        f"survivor did not re-form (exit code {o['survivor_exit_code']})")
    return f"collective failed {o['failed_after_kill_s']:.2f}s after the kill, as {o['error_kind']}; {alive}"


def check_abort(device_kind: str, timeout_s: float) -> dict:
    """Every variant for the device: gloo once; NCCL as raymesh sets it up and with PyTorch's default handling.
    ``ok`` is raymesh's own variant (the first)."""
    variants = [DEFAULT_ENV] if device_kind == "cpu" else [DEFAULT_ENV, TORCH_DEFAULT_ENV]
    results = [run_variant(device_kind, timeout_s, env) for env in variants]
    return {"variants": results, "ok": results[0]["reformed_ok"]}
