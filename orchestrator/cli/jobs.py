"""``raymesh submit|status|logs|stop|inject|scale``: the command-line face of ``orchestrator.client.Client``.

Each takes a submission id (``raymesh submit``, ``ray job submit``) or the job id ``raymesh run`` printed;
``Client`` finds the latter's detached controller through Ray.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from orchestrator.errors import SpecError

DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


def _client(args: argparse.Namespace):
    """The client of the cluster ``--address`` names, else ``RAY_DASHBOARD_ADDRESS``, else the one ``RAY_ADDRESS``
    names (whose GCS knows its dashboard), else the local dashboard."""
    from orchestrator.client import Client

    address = args.address or os.environ.get("RAY_DASHBOARD_ADDRESS") or os.environ.get("RAY_ADDRESS")
    return Client(address or DEFAULT_DASHBOARD, ray_address=getattr(args, "ray_address", None))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _layout(layout: dict[str, Any]) -> str:
    degrees = " ".join(f"{k}={layout[k]}" for k in ("dp", "pp", "tp", "zero") if k in layout)
    return f"{degrees} {layout.get('pp_schedule', '')}, {layout.get('world_size', '?')} ranks".replace(" ,", ",")


def format_status(status: dict[str, Any], now: float | None = None) -> str:
    """A few human-readable lines for ``Client.status``'s dict."""
    head = f"{status['submission_id']}: {status['state']}"
    if status["state"] != status["ray_status"]:
        head += f" (ray: {status['ray_status']})"
    if "step" in status:  # live, from the controller
        lines = [f"{status['job']} {head}, step {status['step']}/{status['total_steps']}"
                 + (f", loss {status['loss']:.4f}" if status["loss"] is not None else "")
                 + f", {status['tokens_per_s']:,.0f} tokens/s"
                 + f", up {_duration((now or time.time()) - status['started_unix'])}"]
        if status["layout"]:
            lines.append(f"layout: {_layout(status['layout'])}")
        if status["health"]:
            rank, age = max(status["health"].items(), key=lambda item: item[1])
            lines.append(f"heartbeats: {len(status['health'])} ranks, oldest {age:.1f}s ago (rank {rank})")
        lines.append(f"control API: {status['control_address']}")
        return "\n".join(lines)
    summary = status.get("summary")
    if summary:
        final = summary.get("final_loss")
        head += (f"; {summary.get('steps')} steps"
                 + (f", final loss {final:.4f}" if final is not None else "")
                 + f", {summary.get('tokens_per_s', 0):,.0f} tokens/s")
    return "\n".join([head] + ([f"message: {status['message']}"] if status.get("message") else []))


def _submit(args: argparse.Namespace) -> int:
    print(_client(args).submit(args.job, args.set, working_dir=args.working_dir))
    return 0


def _status(args: argparse.Namespace) -> int:
    print(format_status(_client(args).status(args.id)))
    return 0


def _logs(args: argparse.Namespace) -> int:
    client = _client(args)
    if not args.follow:
        print(client.logs(args.id), end="")
        return 0
    for chunk in client.tail_logs(args.id):
        print(chunk, end="", flush=True)
    return 0


def _stop(args: argparse.Namespace) -> int:
    reply = _client(args).stop(args.id, args.reason)
    if reply["via"] == "none":
        print(f"{args.id} has already ended: {reply['state']}")
    elif reply["via"] in ("control", "actor"):
        print(f"{args.id}: {reply['state']} (the controller finishes the current step and writes its summary)")
    else:
        print(f"{args.id}: {reply['state']} (control API unreachable; Ray is killing the job, no summary)")
    return 0


def _inject(args: argparse.Namespace) -> int:
    at_step = _client(args).inject_fault(args.id, args.kind, args.rank, args.factor)
    print(f"{args.id}: {args.kind} on rank {args.rank} at step {at_step}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    after = _client(args).request_scale(args.id, args.dp)
    print(f"{args.id}: resizing to dp={args.dp} after step {after}")
    return 0


def _guarded(func):
    """Print a user's mistake or an unreachable cluster as one line, exit 2, no traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (SpecError, LookupError, ConnectionError, PermissionError, TimeoutError, ValueError) as exc:
            print(f"raymesh: error: {exc}", file=sys.stderr)
            return 2
    return run


def add_client_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add submit, status, logs, stop, inject and scale to ``raymesh``'s subcommands."""
    address_help = (f"Ray dashboard URL, used as given (default: RAY_DASHBOARD_ADDRESS, else the cluster RAY_ADDRESS "
                    f"names, else {DEFAULT_DASHBOARD})")

    submit = subparsers.add_parser("submit", help="validate a job file and submit it to a Ray cluster")
    submit.add_argument("job", help="job file (YAML), inside --working-dir")
    submit.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a job-file field (repeatable)")
    submit.add_argument("--working-dir", default=".",
                        help="folder uploaded as the job's working directory (default: .)")
    submit.set_defaults(func=_guarded(_submit))

    for name, func, text in (("status", _status, "a submitted job's state, step, loss and health"),
                             ("logs", _logs, "a submitted job's log"),
                             ("stop", _stop, "stop a submitted job after its current step"),
                             ("inject", _inject, "make a rank of a running job fail at its next step (a drill)"),
                             ("scale", _scale, "resize a running job's data parallelism after its current step")):
        cmd = subparsers.add_parser(name, help=text)
        cmd.add_argument("id", help="submission id (printed by `raymesh submit`) or job id (printed by `raymesh run`)")
        cmd.add_argument("--ray-address", help="Ray cluster address to find a `raymesh run` job's controller "
                                               "(default: RAY_ADDRESS, else the local cluster)")
        cmd.set_defaults(func=_guarded(func))
    subparsers.choices["logs"].add_argument("--follow", "-f", action="store_true",
                                            help="keep printing until the job ends")
    subparsers.choices["stop"].add_argument("--reason", default="requested with `raymesh stop`",
                                            help="recorded in the job log")
    inject = subparsers.choices["inject"]
    inject.add_argument("--kind", required=True,
                        choices=("kill_rank", "kill_node", "hang_rank", "slow_rank", "nan_loss", "raise_error", "oom",
                                 "corrupt_checkpoint"),
                        help="the fault: kill, hang, slow, poison (nan_loss), raise or OOM the rank, kill its node, "
                             "or corrupt the newest checkpoint")
    inject.add_argument("--rank", type=int, default=0, help="the global rank it hits (default 0)")
    inject.add_argument("--factor", type=float, default=3.0, help="slow_rank: how many times slower")
    subparsers.choices["scale"].add_argument("--dp", type=int, required=True, help="the new data-parallel degree")
    for name in ("submit", "status", "logs", "stop", "inject", "scale"):
        subparsers.choices[name].add_argument("--address", help=address_help)
