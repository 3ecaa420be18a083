"""Knowing that a thread is blocked in the code under test, not merely started.

``Thread.start`` returns before the thread has reached its wait: on a loaded machine it may not have taken the lock
yet when the test makes its next move (a restore, a hand-over), and then it arrives after that move and the test
fails for the order the scheduler chose, not for the code. A join with a short timeout only makes that unlikely.
"""

from __future__ import annotations

import threading


class CountingCondition(threading.Condition):
    """A ``threading.Condition`` that counts the waits begun on it. Swapped in for an object's own before any
    thread uses it, ``waits`` tells a test how many times a caller found its predicate false and went to sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1  # under the lock: a caller of ``wait`` holds it
        return super().wait(timeout)
