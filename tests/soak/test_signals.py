"""A soak run stopped by SIGTERM or Ctrl-C still writes its report: the first signal only ends
the traffic loop (the report is then written as usual, marked interrupted); a second one stops
the run at once."""

from __future__ import annotations

import os
import signal

import pytest

from benchmarks.soak.cli import _stop_on_signals


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_ends_traffic_second_stops(sig, restore_handlers):
    stop = _stop_on_signals()
    assert not stop.is_set()
    os.kill(os.getpid(), sig)   # delivered to the main thread before kill returns here
    assert stop.is_set()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), sig)
