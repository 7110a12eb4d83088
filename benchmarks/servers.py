"""Start and stop the compared servers with identical model and settings.

The three systems differ only in their cache flags; everything else (model, context length,
seed, `--enable-prompt-tokens-details`, KV space, extra flags) is one `ServerSettings` shared by
all, so a difference in the report is the cache's doing:

- `native`:  stock vLLM with its own prefix caching (`--enable-prefix-caching`; for hybrid models
  vLLM 0.32 then runs `mamba_cache_mode=align`).
- `nocache`: stock vLLM with prefix caching off (`--no-enable-prefix-caching`): the floor.
- `ours`:    `vllm serve MODEL --plugin hybridcache`, started by the same `vllm` command, exactly
  as a user types it.

Each server runs in its own process group so that stopping it (SIGTERM, then SIGKILL after a
grace period) also stops vLLM's engine-core and worker processes, and nothing else. Its output
goes to a log file that the report names; a server that dies during start-up is reported with
the tail of that log.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import msgspec
import requests


class SystemSpec(msgspec.Struct, frozen=True):
    """One compared system: the flags that select its cache, and what they mean."""

    name: str
    flags: list[str]
    description: str
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """Extra environment for the server (the plugin's feature switches for ablations)."""
    model: str = ""
    """An embedded model this system serves instead of the run's `--model` (under the same
    served name): a quantized twin of it, compared side by side in one run. `{model}` stands
    for the run's model (`ServerSettings.model_name`)."""


# The plugin's features one at a time (issue "conversations"): grid links only, then message-end
# cuts, then end anchors (`ours`, the default setting). Same command as `ours`, env switches.
_GRID_ONLY = {"VLLM_HYBRIDCACHE_MESSAGE_END_IDS": "-1", "VLLM_HYBRIDCACHE_SESSION_ANCHORS": "0"}
_NO_ANCHORS = {"VLLM_HYBRIDCACHE_SESSION_ANCHORS": "0"}
# TP = 2 on vLLM's CPU backend: one core per rank, the first two this process may use
_TP2_CORES = "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])

SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec("native", ["--enable-prefix-caching"],
                   "vLLM 0.32, native prefix caching on (hybrid: mamba_cache_mode=align)"),
        SystemSpec("nocache", ["--no-enable-prefix-caching"],
                   "vLLM 0.32, prefix caching off"),
        SystemSpec("ours", ["--plugin", "hybridcache"],
                   "vLLM 0.32 + vllm-hybridcache (`--plugin hybridcache`)"),
        SystemSpec("ours-grid", ["--plugin", "hybridcache"],
                   "vllm-hybridcache with grid links only (no message-end cuts, no end "
                   "anchors: " + " ".join(f"{k}={v}" for k, v in _GRID_ONLY.items()) + ")",
                   env=_GRID_ONLY),
        SystemSpec("ours-msgend", ["--plugin", "hybridcache"],
                   "vllm-hybridcache with grid links and message-end cuts, no end anchors ("
                   + " ".join(f"{k}={v}" for k, v in _NO_ANCHORS.items()) + ")",
                   env=_NO_ANCHORS),
        SystemSpec("ours-fine", ["--plugin", "hybridcache"],
                   "vllm-hybridcache with Flash-Next's split-invariant forward forced on "
                   "(VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT=1: fine segmentation, "
                   "whatever the dtype and host; models without that forward run as ours)",
                   env={"VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT": "1"}),
        SystemSpec("ours-step", ["--plugin", "hybridcache"],
                   "vllm-hybridcache with Flash-Next's split-invariant forward off "
                   "(VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT=0: step segmentation, the "
                   "default before auto; models without that forward run as ours)",
                   env={"VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT": "0"}),
        SystemSpec("ours-pinned", ["--plugin", "hybridcache"],
                   "vllm-hybridcache with vLLM's CPU attention pinned split-invariant "
                   "(VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT=1: fine segmentation for "
                   "Qwen3-Next on vLLM's CPU backend, bf16)",
                   env={"VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT": "1"}),
        SystemSpec("ours-nowait", ["--plugin", "hybridcache"],
                   "vllm-hybridcache with a prefill cut short by other prefills taking the "
                   "tokens left instead of waiting for a step with room "
                   "(VLLM_HYBRIDCACHE_STEP_WAIT=0: it is not cached past that point, as "
                   "before step_wait)",
                   env={"VLLM_HYBRIDCACHE_STEP_WAIT": "0"}),
        SystemSpec("ours-tp2", ["--plugin", "hybridcache", "--tensor-parallel-size", "2"],
                   "vllm-hybridcache at tensor parallel size 2 (vLLM's CPU backend: one worker "
                   f"process per rank, VLLM_CPU_OMP_THREADS_BIND={_TP2_CORES})",
                   env={"VLLM_CPU_OMP_THREADS_BIND": _TP2_CORES}),
        SystemSpec("ours-w8a8", ["--plugin", "hybridcache"],
                   "vllm-hybridcache on the run's model's W8A8 twin (`<model>-w8a8`): the same "
                   "weights as compressed-tensors W8A8 int8 (dense linears int8, routed "
                   "experts bf16)",
                   model="{model}-w8a8"),
        SystemSpec("ours-copy", ["--plugin", "hybridcache"],
                   "vllm-hybridcache with attention K/V copied, not shared in place "
                   "(VLLM_HYBRIDCACHE_ATTENTION_IN_PLACE=0: a hit's attention rows are copied "
                   "from the link into the request's own blocks, as before in place became "
                   "the default)",
                   env={"VLLM_HYBRIDCACHE_ATTENTION_IN_PLACE": "0"}),
    )
}


class ServerSettings(msgspec.Struct, frozen=True):
    """Everything the systems share; the report records it."""

    model_path: str
    served_name: str
    max_model_len: int
    model_name: str = ""
    """The embedded model's catalog name, when the run serves one (a system's `model`
    template names its twin from it)."""
    host: str = "127.0.0.1"
    port: int = 8100
    seed: int = 0
    kv_cache_space_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE (CPU builds only; ignored by GPU builds)."""
    extra_args: list[str] = msgspec.field(default_factory=list)
    startup_timeout_s: float = 600.0
    vllm: str = ""
    """The `vllm` command; empty = the one next to this Python, else the one on PATH."""


class ServerError(RuntimeError):
    """A server did not come up; the message carries the tail of its log."""


def vllm_command(settings: ServerSettings) -> str:
    if settings.vllm:
        return settings.vllm
    beside = Path(sys.executable).with_name("vllm")
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm")
    if found is None:
        raise ServerError("no `vllm` command found; install vllm-hybridcache or pass --vllm")
    return found


def server_argv(spec: SystemSpec, settings: ServerSettings, port: int) -> list[str]:
    """The exact command line of one system (also written to the report)."""
    model_path = settings.model_path
    if spec.model:
        from vllm_hybridcache.models import ensure_model

        base = settings.model_name or settings.served_name
        model_path = str(ensure_model(spec.model.format(model=base)))
    return [
        vllm_command(settings), "serve", model_path,
        *spec.flags,
        "--served-model-name", settings.served_name,
        "--host", settings.host, "--port", str(port),
        "--max-model-len", str(settings.max_model_len),
        "--enable-prompt-tokens-details",
        "--seed", str(settings.seed),
        *settings.extra_args,
    ]


def server_env(settings: ServerSettings, spec: SystemSpec | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if spec is not None:
        env.update(spec.env)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_space_gib))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Exposes POST /reset_prefix_cache, so one server can replay several traces from a clean
    # cache instead of paying a start-up per trace. It adds only development routes.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def reset_cache(base_url: str, headers: dict[str, str] | None = None) -> bool:
    """Empty the server's prefix cache, the connector's (our plugin's) included.

    True only if the server says it worked; a server without the route (not in dev mode, or
    not vLLM) answers 404 and this returns False.
    """
    try:
        r = requests.post(base_url.rstrip("/") + "/reset_prefix_cache",
                          params={"reset_external": "true"}, headers=headers or {}, timeout=60)
    except requests.RequestException:
        return False
    if r.status_code != 200:
        return False
    try:
        return bool(r.json().get("success"))
    except ValueError:
        return False


def free_port(host: str, first: int, span: int = 100) -> int:
    """The first port in [first, first+span) nobody listens on (others share this machine)."""
    for port in range(first, first + span):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise ServerError(f"no free port in {first}..{first + span - 1}")


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` or one of its descendants listens on TCP `port`.

    Why: two runners on one machine can pick the same free port at the same moment (the check
    and the server's bind are not one step). The second server then fails to bind, but its
    runner's /health poll is answered by the first one, and it would replay against another
    system's server. So a start counts only once the listener is the process it started.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in conns):
            return True
    return False


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after `grace_s`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait(timeout=grace_s)
    # The group may outlive its leader for a moment (engine core, workers): make sure it is gone.
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return


class RunningServer(msgspec.Struct):
    """A started server: where it listens, how it was started, how long start-up took."""

    name: str
    base_url: str
    argv: list[str]
    log_path: str
    startup_s: float
    pid: int


def process_tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by a server and all its child processes.

    Why: on a shared machine wall-clock times move with everyone else's load, but the CPU time
    the server itself burns is its own work (prefill, decode, cache copies), so the difference
    over a replay is a load-robust cost to compare systems by.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


@contextmanager
def running_server(spec: SystemSpec, settings: ServerSettings,
                   log_path: Path) -> Iterator[RunningServer]:
    """Start one system, wait until /health answers, yield it, always stop it."""
    port = free_port(settings.host, settings.port)
    argv = server_argv(spec, settings, port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    base_url = f"http://{settings.host}:{port}"
    start = time.monotonic()
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(argv) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=server_env(settings, spec),
                                start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise ServerError(f"{spec.name}: server exited with {proc.returncode} during "
                                  f"start-up; log {log_path}:\n{_tail(log_path)}")
            if time.monotonic() - start > settings.startup_timeout_s:
                raise ServerError(f"{spec.name}: not healthy after "
                                  f"{settings.startup_timeout_s:.0f} s; log {log_path}:\n"
                                  f"{_tail(log_path)}")
            try:
                healthy = requests.get(base_url + "/health", timeout=2).status_code == 200
            except requests.RequestException:
                healthy = False
            if healthy and listens_on(proc.pid, port):  # not another runner's server
                break
            time.sleep(1.0)
        yield RunningServer(name=spec.name, base_url=base_url, argv=argv,
                            log_path=str(log_path), startup_s=time.monotonic() - start,
                            pid=proc.pid)
    finally:
        _stop(proc)


@contextmanager
def running_servers(*servers: tuple[SystemSpec, ServerSettings, Path]
                    ) -> Iterator[list[RunningServer]]:
    """Start several servers at once (their start-ups overlap), yield them in order, always
    stop them all; if one fails to start, the others are stopped and its error raised."""
    cms = [running_server(spec, settings, log) for spec, settings, log in servers]
    with ExitStack() as stack, ThreadPoolExecutor(len(cms)) as pool:
        futures = [pool.submit(cm.__enter__) for cm in cms]
        started, error = [], None
        for cm, fut in zip(cms, futures, strict=True):
            try:
                started.append(fut.result())
                stack.push(cm.__exit__)
            except BaseException as e:  # the others are stopped by the stack, then it raises
                error = error or e
        if error is not None:
            raise error
        yield started
