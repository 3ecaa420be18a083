"""An S3-compatible server (moto's) on a free loopback port, with the standard AWS variables pointing at it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def s3_server(bucket: str) -> Iterator:
    """Start the server, set ``AWS_*`` in this process's environment (so spawned ranks and Ray nodes started
    from here inherit them), create ``bucket``; yield an fsspec S3 file system for it (listings uncached)."""
    import fsspec
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    # fsspec keeps one S3FileSystem per set of arguments for the life of the process, bound to the endpoint in
    # the environment when it was made: an earlier server's instance would be reused and connect to a dead port
    S3FileSystem.clear_instance_cache()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        with pytest.MonkeyPatch.context() as env:
            for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
                env.setenv(key, value)
            fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
            fs.mkdir(bucket)
            yield fs
    finally:
        server.stop()
        S3FileSystem.clear_instance_cache()
