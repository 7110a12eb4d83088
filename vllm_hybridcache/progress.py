"""Progress of long work: a tqdm bar on a terminal, a few log lines in a server log.

Why: three jobs run long and used to run in silence: hashing a checkpoint's weights for the
engine fingerprint on the first start with the disk tier (adapter/fingerprint.py: every byte of
an 80B-class checkpoint, ~160 GB), verifying a cache folder (`vllm-hybridcache disk verify`,
every part's CRC and MAC), and the cluster launcher waiting for its replicas (up to 900 s).
A person at a terminal gets a tqdm bar on stderr; a server log (a container, systemd: stderr
is no terminal, and a bar's carriage returns would be one endless line there) gets a line every
`interval_s` seconds through the given logger instead, and a last line at the end, and only
once the work has run `interval_s`: short work says nothing either way (tqdm's `delay` does
the same on a terminal).

The log lines go through the `vllm_hybridcache` logger, which the plugin routes through vLLM's
handlers (compat.route_logs_through_vllm), so they land in the server log beside vLLM's own.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from vllm_hybridcache.units import human_bytes

__all__ = ["Progress"]


class Progress:
    """A bar of `total` units of `desc`, updated with `update(n)`.

    unit: "B" shows sizes (KiB, MiB, ...), anything else counts (e.g. "replica").
    logger: where the periodic lines go when `stream` is not a terminal; None: say nothing
        then (the CLI's own result lines are its output).
    status: called at each update for a short text shown after the figures (which replicas
        are still starting).
    stream: the bar's terminal (default stderr); clock: injected by tests.
    """

    def __init__(self, total: int, desc: str, *, unit: str = "B",
                 logger: logging.Logger | None = None, interval_s: float = 30.0,
                 status: Callable[[], str] | None = None, stream: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = max(0, int(total))
        self.desc = desc
        self.unit = unit
        self.done = 0
        self._logger = logger
        self._interval = interval_s
        self._status = status
        self._clock = clock
        self._start = self._last_line = clock()
        self._lines = 0  # log lines written (the last line follows only if one was)
        stream = sys.stderr if stream is None else stream
        self._bar: Any = None
        if _is_tty(stream) and self.total > 0:  # nothing to do: nothing to show
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit,
                             unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                             file=stream, delay=min(2.0, interval_s), leave=False,
                             dynamic_ncols=True)

    def update(self, n: int = 0) -> None:
        """Count `n` more units done (0: only refresh the status and the time)."""
        self.done += n
        if self._bar is not None:
            if self._status is not None:
                self._bar.set_postfix_str(self._status(), refresh=False)
            self._bar.update(n)
            return
        now = self._clock()
        if self._logger is not None and now - self._last_line >= self._interval:
            self._last_line = now
            self._lines += 1
            self._logger.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        """What a log line says: done of total, the share, the time so far, the rate."""
        return f"{self.desc}: {self._figures(self._clock() if now is None else now)}"

    def _figures(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        if self.unit == "B":
            figures = f"{human_bytes(self.done)} of {human_bytes(self.total)}"
            rate = f", {human_bytes(int(self.done / elapsed))}/s"
        else:
            figures = f"{self.done} of {self.total} {self.unit}s"
            rate = ""
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        status = f"; {self._status()}" if self._status is not None else ""
        return f"{figures}{share}, {elapsed:.0f} s{rate}{status}"

    def close(self) -> None:
        """End the bar; a log that had periodic lines gets a final one."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._logger is not None and self._lines:
            self._logger.info("%s: done, %s", self.desc, self._figures(self._clock()))
            self._lines = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False
