"""Read a running job's parameters over gRPC from any process, no Ray needed (an eval or inference server).

``python -m parameter_server.reader RUN_DIR/ps_routes.json --out params.pt``
writes {name: tensor} of the newest weights; ``pull_parameters`` returns them.
The routes file (written by the controller, rewritten when a shard restarts)
gives each shard's address and the ring's shape, so the reader finds every
chunk where a worker would, and where the job's token is (``ray``: Ray's token
on this machine; else the run directory's secret file); ``RAYMESH_TOKEN``
overrides it. The shards answer no call without it. When the job file gives the
shards a certificate (``parameter_server.tls_cert``), the file names it too and
the reader speaks TLS trusting it, or ``RAYMESH_TLS_CA`` (a copy of it, or of
its CA, on this machine), as a control API client does.

The file steers where the reader sends the job's token, so it is trusted only as
the controller leaves it (``write_routes``): a regular file of this user's that
nobody else may write; and the secret is always the ``control_token`` beside it,
never a path the file names (which could be any one-line file of the user's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from parameter_server.auth import RAY_SOURCE, TOKEN_FILE, client_token, read_own_file
from parameter_server.client import PSClient
from parameter_server.errors import ShardDown
from parameter_server.grpc_service import GrpcConn
from parameter_server.tls import TLS_CA_ENV, trusted_root

ROUTES_FILE = "ps_routes.json"  # in the run directory
_ROUTES_MODE = 0o644  # others may read where the shards are (no secret in it), only the job's user may change it
_ROUTES_RISK = "could send this reader, and the job's token, to an address of theirs"


def write_routes(run_dir: Path, routes: dict) -> None:
    """``routes`` into ``run_dir``'s routes file, mode 0644 whatever the umask (``read_routes`` refuses one its
    group may write) and by a rename: a reader never sees half a file, and a link planted there is replaced, its
    target left alone."""
    path = run_dir / ROUTES_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, _ROUTES_MODE)
    os.fchmod(fd, _ROUTES_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(routes, indent=2))
    os.replace(tmp, path)


def read_routes(routes_path: str | Path) -> dict:
    """The routes file as the controller left it; ``PermissionError`` naming the path, the problem and the fix
    when someone else owns it or may write it (``read_own_file``)."""
    text = read_own_file(routes_path, "routes file", _ROUTES_RISK, others_may_write=False,
                         fix="read the one the job's controller wrote, as the user who runs the job, or restart the "
                             "job, which writes it again")
    return json.loads(text)


def routes_token(routes: dict, routes_path: str | Path) -> str:
    """The job's token for ``routes``: Ray's when the job uses Ray's, else the ``control_token`` beside the routes
    file (``RAYMESH_TOKEN`` wins either way, ``client_token``)."""
    source = RAY_SOURCE if routes.get("token") == RAY_SOURCE else str(Path(routes_path).parent / TOKEN_FILE)
    return client_token(source)


def connect(routes_path: str | Path) -> PSClient:
    """A client of the shards ``routes_path`` names, their layout read; close it with ``close(client)``."""
    routes = read_routes(routes_path)
    token = routes_token(routes, routes_path)
    root = trusted_root(routes["tls_cert"], "the job's parameter-server shards") if "tls_cert" in routes else None
    client = PSClient([GrpcConn(a, token, root) for a in routes["addresses"]], routes["chunk_elems"],
                      routes["vnodes"])
    try:
        infos = client.clocks()
        if not infos:  # else an empty layout: the reader would write {} as the job's weights
            raise ShardDown(f"none of the {len(client.conns)} parameter-server shards in {routes_path} answered; "
                            "fix: check that the job is still running and that this machine reaches their addresses "
                            f"(and, when the file names a tls_cert, that it or {TLS_CA_ENV} is the shards' "
                            "certificate)")
    except BaseException:
        close(client)
        raise
    for info in infos:  # every shard keeps the whole model's layout
        client.layout.update(info["layout"])
    return client


def close(client: PSClient) -> None:
    """Release every channel: one left open with a call in flight (a shard that refused another's token, one
    that did not answer) can keep the process from exiting."""
    for conn in client.conns:
        conn.close()


def pull_parameters(routes_path: str | Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    client = connect(routes_path)
    try:
        return client.pull(names or sorted(client.layout))
    finally:
        close(client)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("routes", help="ps_routes.json in the job's run directory")
    parser.add_argument("--out", required=True, help="where to torch.save the {name: tensor} dict")
    args = parser.parse_args(argv)
    try:
        params = pull_parameters(args.routes)
    except (PermissionError, ShardDown, TimeoutError) as exc:  # each names its fix: no traceback to read
        sys.exit(f"raymesh reader: {exc}")
    torch.save(params, args.out)


if __name__ == "__main__":
    main()
