"""A Google Cloud Storage emulator (gcp-storage-emulator's, in memory) on a free loopback port, with
``STORAGE_EMULATOR_HOST`` pointing gcsfs at it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def gcs_server(bucket: str) -> Iterator:
    """Start the emulator with ``bucket`` made, set ``STORAGE_EMULATOR_HOST`` in this process's environment;
    yield an fsspec GCS file system for it (listings uncached)."""
    import fsspec
    from gcp_storage_emulator.server import create_server
    from gcsfs import GCSFileSystem

    # as for S3 (s3_server.py): a cached GCSFileSystem would keep an earlier endpoint
    GCSFileSystem.clear_instance_cache()
    # gcsfs first asks Google's credential chain and logs each miss; the emulator needs no credentials
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
    server.start()
    port = server._api._httpd.server_address[1]  # port 0: the emulator keeps the bound port only here
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
            yield fsspec.filesystem("gs", skip_instance_cache=True, use_listings_cache=False)
    finally:
        server.stop()
        GCSFileSystem.clear_instance_cache()
