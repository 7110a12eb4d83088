"""One serving replica as a Ray actor: an ordinary `vllm serve MODEL --plugin hybridcache` on a
private port of the node Ray placed it on, with the cluster tier on.

Why a `vllm serve` process rather than an engine inside the actor: the replica then serves
exactly what a single-box user runs (vLLM's OpenAI server, the plugin's `/v1/cache/*` routes,
its Prometheus series), with no serving code of ours in between. Ray places the replica (its
`num_cpus`/`num_gpus`; on GPUs Ray sets CUDA_VISIBLE_DEVICES, which the server inherits),
addresses it and tells the front whether it lives. The server runs in its own process group,
so stopping or killing the replica stops vLLM's engine-core process with it; the server also
gets SIGTERM when the actor's process dies (PR_SET_PDEATHSIG), so no engine outlives its actor.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from vllm_hybridcache.config import setting_env

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerReplica:
    """The actor's body (wrapped by `server_replica_actor`).

    name: the replica's name (its owner name in the cluster directory, its `replica` label);
    model: a checkpoint folder; serve_args: further `vllm serve` flags; env: extra environment
    (VLLM_HYBRIDCACHE_* settings); plugin: serve with `--plugin hybridcache` (off: stock vLLM,
    for comparisons); cluster_tier: join the cluster tier (off: a private cache only).
    """

    def __init__(self, name: str, model: str, serve_args: list[str], env: dict[str, str],
                 plugin: bool = True, cluster_tier: bool = True) -> None:
        self.name = name
        self.host = ray.util.get_node_ip_address()
        self.port = _free_port(self.host)
        gcs = ray.get_runtime_context().gcs_address
        self.log_path = Path(tempfile.gettempdir()) / f"hybridcache-{name}-{self.port}.log"
        full_env = {**os.environ, **env}
        if plugin and cluster_tier:
            full_env[setting_env("cluster_address")] = gcs
            full_env[setting_env("cluster_replica")] = name
        full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.argv = [sys.executable, "-m", "vllm_hybridcache.cli.vllm_entry", "serve", model,
                     *(["--plugin", "hybridcache"] if plugin else []),
                     "--host", self.host, "--port", str(self.port), *serve_args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=full_env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)

    def endpoint(self) -> tuple[str, str]:
        """(name, base URL)."""
        return self.name, f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the server's process group (the engine with it): what a lost machine
        looks like to the others. The actor stays, reporting the replica dead."""
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the group (vLLM drains and withdraws its links), SIGKILL what is left."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            self._signal(signal.SIGKILL)
            time.sleep(0.2)
        if self.proc.poll() is None:
            self.proc.wait()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def server_replica_actor(num_cpus: float = 1, num_gpus: float = 0) -> Any:
    """The Ray actor class of one serving replica (the resources its engine needs)."""
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)(ServerReplica)
