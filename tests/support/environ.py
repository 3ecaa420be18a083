"""Environment variables put back as a test found them."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def kept_env(*names: str):
    """Put ``names`` back as they were before the block (an unset one unset) whatever the block set.

    Why: code under test sets some in the process it runs in (``os.environ.setdefault`` in
    ``workers.parallel.process_group``); in a unit test that is the test session's own process, and every later test
    would inherit them, as would the Ray cluster the integration tests start from its environment.
    """
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
