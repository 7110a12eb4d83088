"""The machine's load while a benchmark measures: sampled, waited on, recorded.

Every published figure comes from a 2-core machine that other jobs may share. A load average
read only before and after a replay misses a job that ran in between, so the runner samples it
once a second during each replay (`LoadSampler`) and, before one starts, waits a bounded time
for the machine to be quiet (`wait_for_quiet`). Whether a result counts as loaded is decided in
one place, `benchmarks.report.loaded`, from what is recorded here.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable


class LoadSampler:
    """The highest 1-minute load average seen while the `with` block runs.

    `read` and `interval_s` are injectable so tests need no real load."""

    def __init__(self, interval_s: float = 1.0,
                 read: Callable[[], float] = lambda: os.getloadavg()[0]) -> None:
        self._interval = interval_s
        self._read = read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak: float | None = None

    def _sample(self) -> None:
        value = float(self._read())
        self.peak = value if self.peak is None else max(self.peak, value)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def __enter__(self) -> LoadSampler:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="load-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


def wait_for_quiet(limit: float, timeout_s: float,
                   read: Callable[[], float] = lambda: os.getloadavg()[0],
                   sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic, poll_s: float = 5.0) -> float:
    """Wait until the 1-minute load average is at most `limit`, for at most `timeout_s`.

    Returns the last load read. The caller runs anyway when it is still above (the result is
    then flagged, not dropped: a loaded result still tells cached shares, which do not depend on
    load)."""
    deadline = clock() + timeout_s
    value = float(read())
    while value > limit and clock() < deadline:
        sleep(min(poll_s, max(deadline - clock(), 0.0)))
        value = float(read())
    return value
