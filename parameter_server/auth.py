"""Bearer-token authentication for raymesh's own gRPC services: the control API and the parameter-server shards.

Every call carries ``authorization: Bearer <token>`` metadata; a server
interceptor compares it in constant time and answers ``UNAUTHENTICATED``
before any servicer method runs, so an unauthenticated call changes nothing.
Ray's own gRPC interceptor does the same for Ray's ports but is private API
and only knows Ray's token (which is off on some clusters), hence these few
lines. The token is Ray's when Ray's token authentication is on, else a
per-job secret (``orchestrator/api/auth.py`` picks it). It lives here, in the
layer every other package may import, so the shards, their clients and the
control API share one check.
"""

from __future__ import annotations

import errno
import hmac
import os
import stat
from pathlib import Path

import grpc

HEADER = "authorization"
TOKEN_FILE = "control_token"  # the per-job secret's name in the run directory
TOKEN_ENV = "RAYMESH_TOKEN"  # a client's override: the token itself
RAY_SOURCE = "ray"  # what a job announces when its token is Ray's
_DENIED = ("raymesh: missing or wrong authentication token; fix: use the job's token (Ray's token when Ray's "
           "token authentication is on, else the control_token file in the job's run directory)")


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client adds to every call."""
    return ((HEADER, f"Bearer {token}"),)


def _deny(requests, context: grpc.ServicerContext):
    """Refuse without reading the request: a unary handler would first wait on a server thread for the whole
    message, so a caller without the token could hold every thread by never sending it, or make the server
    buffer a message up to its size limit (512 MiB for a shard) before being refused."""
    context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only with ``authorization: Bearer <token>`` (every raymesh RPC is unary-unary)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty token would let every caller in; fix: pass the job's token")
        self._expected = f"Bearer {token}".encode()
        self._denied = grpc.stream_unary_rpc_method_handler(_deny)  # streamed: the body is never read

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get(HEADER, "")
        if isinstance(given, bytes) or not hmac.compare_digest(given.encode(), self._expected):
            return self._denied
        return continuation(handler_call_details)


def ray_token() -> str | None:
    """Ray's cluster token as this machine has it, whether or not this process runs in Ray's token mode; None
    when there is none.

    Read from Ray's documented places in Ray's order (``RAY_AUTH_TOKEN``, the file
    ``RAY_AUTH_TOKEN_PATH`` names, ``~/.ray/auth_token``) rather than through Ray's
    C++ loader, so a reader outside the cluster does not have to import Ray.
    """
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    if path.is_file():
        return path.read_text().strip() or None
    return None


def client_token(source: str | None) -> str:
    """The token for a job that announced ``source`` (``ray``, or its secret file's path); ``RAYMESH_TOKEN``
    wins (e.g. the file was copied off the cluster). ``PermissionError`` naming the fix when there is none."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if source == RAY_SOURCE:
        token = ray_token()
        if token:
            return token
        raise PermissionError("the job uses the Ray cluster's token, which this machine does not have; fix: set "
                              "RAY_AUTH_TOKEN (`ray get-auth-token` on the head node prints it)")
    if source and os.path.lexists(source):
        return read_secret(source, f"delete it and restart the job, which makes a new one, or put the job's token "
                                   f"in {TOKEN_ENV} on this machine")
    raise PermissionError(f"the job's token file {source or '<run_dir>/' + TOKEN_FILE} is not readable here; "
                          f"fix: copy its content into {TOKEN_ENV} on this machine")


_TOKEN_RISK = "could choose the token or a file to chmod"


def read_secret(path: str | Path, fix: str, mode: int | None = None) -> str:
    """The token in ``path``, which must be a regular file of this user's with one name: a link planted there by
    someone who may write the directory would let them choose the token (a file whose content they know) or have
    ``mode`` set on a file of the user's. ``PermissionError`` naming the path, the problem and ``fix`` otherwise
    (``read_own_file``)."""
    return read_own_file(path, "token file", _TOKEN_RISK, fix, mode)


def read_own_file(path: str | Path, what: str, risk: str, fix: str, mode: int | None = None,
                  others_may_write: bool = True) -> str:
    """The text of ``path`` (a ``what``), a regular file of this user's with one name and, unless
    ``others_may_write``, writable by this user alone: else whoever may write it or its directory ``risk``.
    Checked, chmod-ed to ``mode`` and read through one descriptor opened without following a link, so nothing can
    be swapped in between. ``PermissionError`` naming the path, the problem and ``fix`` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # NONBLOCK: a FIFO's open
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW's refusal of a link (EMLINK on FreeBSD)
            raise
        raise PermissionError(_unsafe(path, what, "is a symbolic link", risk, fix)) from None
    try:
        problem = _problem(os.fstat(fd), others_may_write)
        if problem:
            raise PermissionError(_unsafe(path, what, problem, risk, fix))
        if mode is not None:
            os.fchmod(fd, mode)
        with open(fd, closefd=False) as f:
            return f.read().strip()
    finally:
        os.close(fd)


def _problem(info: os.stat_result, others_may_write: bool) -> str | None:
    """What makes the opened file unfit to be trusted, None when nothing does."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    if info.st_nlink != 1:
        return f"has {info.st_nlink} names (hard links)"
    if not others_may_write and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"may be written by its group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _unsafe(path: str | Path, what: str, problem: str, risk: str, fix: str) -> str:
    return (f"the {what} {path} {problem}; a {what} must be a regular file of this user's with one name, else "
            f"whoever may write its directory {risk}; fix: {fix}")


def ray_token_auth_on() -> bool:
    """Whether this process talks to Ray in token mode (``RAY_AUTH_MODE=token``, inherited inside a cluster
    whose head runs with token authentication)."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()
