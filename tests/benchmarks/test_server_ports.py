"""The benchmark runner counts a server as started only when the process it started is the one
listening on the port: another runner's server answering /health on the same port (both picked
it at the same moment) must not be replayed against."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from benchmarks.servers import free_port, listens_on

_LISTEN = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])));"
           " s.listen(); print('up', flush=True); time.sleep(60)")


def _listener(port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _LISTEN, str(port)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def test_the_listener_is_told_apart_from_another_process():
    port = free_port("127.0.0.1", 18700)
    owner = _listener(port)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert listens_on(owner.pid, port)
        assert not listens_on(other.pid, port)          # alive, but not the one listening
        assert not listens_on(owner.pid, port + 1)
    finally:
        for p in (owner, other):
            p.kill()
            p.wait()
    assert not listens_on(owner.pid, port)              # gone: no longer listening


def test_a_descendant_listening_counts_for_its_parent():
    port = free_port("127.0.0.1", 18800)
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {_LISTEN!r}, '{port}']);"
                               " time.sleep(60)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not listens_on(parent.pid, port):
            assert time.monotonic() < deadline, "the child never listened"
            time.sleep(0.1)
        with socket.socket() as s:                      # the port really is taken
            assert s.connect_ex(("127.0.0.1", port)) == 0
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
