"""The soak run's server: `vllm serve --plugin hybridcache`, killed with SIGKILL and restarted
on the same `disk_dir` when the fault schedule says so.

`benchmarks.servers.running_server` starts a server for the length of a `with` block; a soak
run needs more: the same command started again after a kill -9 (a *life* per start), the root
pid of the current life for the memory probe, and a way for traffic threads to wait while the
server is down. Command line and environment come from `benchmarks.servers`, so the soak
server is started exactly as the benchmarks start `ours`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import requests

from benchmarks.servers import (
    SYSTEMS,
    ServerError,
    ServerSettings,
    free_port,
    server_argv,
    server_env,
)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


class SoakServer:
    """One server command, started once per life; `up` is set while it answers."""

    def __init__(self, settings: ServerSettings, env: dict[str, str], log_dir: Path) -> None:
        self.settings = settings
        self.env = env
        self.log_dir = log_dir
        self.port = free_port(settings.host, settings.port)
        self.base_url = f"http://{settings.host}:{self.port}"
        self.argv = server_argv(SYSTEMS["ours"], settings, self.port)
        self.proc: subprocess.Popen[bytes] | None = None
        self.life = 0
        self.startups: list[float] = []
        self.up = threading.Event()
        self.lock = threading.Lock()

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"server-life{self.life}.log"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> float:
        """Start a new life and wait until /health answers; its start-up seconds."""
        self.life += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = server_env(self.settings)
        env.update(self.env)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with {self.proc.returncode} during start-up "
                                  f"(life {self.life}); log {self.log_path}:\n"
                                  f"{_tail(self.log_path)}")
            if time.monotonic() - t0 > self.settings.startup_timeout_s:
                raise ServerError(f"server not healthy after {self.settings.startup_timeout_s:.0f}"
                                  f" s (life {self.life}); log {self.log_path}")
            try:
                if requests.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        took = time.monotonic() - t0
        self.startups.append(took)
        self._instrument()
        self.up.set()
        return took

    def _instrument(self) -> None:
        """Put the workers' instrumentation in place before any traffic (the first call of a
        worker extension method builds it, testing/instrumentation.py), so the in-place check
        sees a life's first restores too; best effort: the monitor's samples build it anyway."""
        try:
            requests.post(self.base_url + "/collective_rpc", timeout=10,
                          json={"method": "hybridcache_fault_counts"})
        except requests.RequestException:
            pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL the whole process group (API server, engine core, workers) at once."""
        self.up.clear()
        if self.proc is None:
            return
        _kill_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._wait_group_gone(30.0)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the group, SIGKILL what is left after `grace_s`."""
        self.up.clear()
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _kill_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self._wait_group_gone(grace_s):
            _kill_group(self.proc.pid, signal.SIGKILL)
            self._wait_group_gone(grace_s)

    def _wait_group_gone(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        return False
