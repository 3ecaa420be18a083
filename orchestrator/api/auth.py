"""Which token a job's control API and parameter-server shards demand, and where a client finds it.

When Ray's token authentication is on (Ray 2.60's default once a token exists,
e.g. ``~/.ray/auth_token``), the job uses Ray's own token: whoever may submit
to the cluster may also steer its jobs, and there is nothing new to hand out.
Otherwise it is a per-job secret written with mode 0600 into the run
directory as ``control_token``; the CLI and ``orchestrator.Client`` read it
from the path the controller announces, or from ``RAYMESH_TOKEN``. Both read it
with ``parameter_server.auth.read_secret``, which refuses a link planted there.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from parameter_server.auth import (
    RAY_SOURCE,
    TOKEN_ENV,
    TOKEN_FILE,
    client_token,
    ray_token,
    ray_token_auth_on,
    read_secret,
)

__all__ = ["RAY_SOURCE", "TOKEN_ENV", "TOKEN_FILE", "JobToken", "client_token", "job_token",
           "use_ray_token_if_present"]


@dataclass(frozen=True)
class JobToken:
    value: str
    source: str  # "ray", or the absolute path of the per-job secret file

    def __repr__(self) -> str:  # never print the secret
        return f"JobToken(source={self.source!r})"


def job_token(run_dir: str | Path) -> JobToken:
    """Ray's token when this process runs in Ray's token mode, else the run directory's secret (made once)."""
    if ray_token_auth_on():
        token = ray_token()
        if token:
            return JobToken(token, RAY_SOURCE)
    path = Path(run_dir).resolve() / TOKEN_FILE
    return JobToken(_read_or_create(path), str(path))


def _read_or_create(path: Path) -> str:
    """The secret in ``path``, created 0600 if absent (O_EXCL: two callers of one job read the same secret; a
    link there counts as present, and ``read_secret`` refuses it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:  # 0600 again: a copied run directory may have widened it
        return read_secret(path, "delete it; the job makes a new one", mode=0o600)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def use_ray_token_if_present() -> None:
    """Talk to Ray in token mode when this machine has Ray's token and ``RAY_AUTH_MODE`` is unset.

    Ray does this itself only for ``ray.init()`` without an address; a driver or
    job client given an address (``ray.init(address=...)``, the job SDK) would
    otherwise send no token and be refused with "Missing authentication token".
    An explicit ``RAY_AUTH_MODE`` is left alone.
    """
    if "RAY_AUTH_MODE" in os.environ or ray_token() is None:
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray._raylet import Config

    Config.initialize("")  # Ray reads the mode once per process; this makes it read it again
