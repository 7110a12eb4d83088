"""One command for N replicas behind one OpenAI port: `vllm-hybridcache cluster MODEL`.

Joins the Ray cluster at `--address` (or starts a local one), places N serving replicas as Ray
actors (server_replica.py: each an ordinary `vllm serve MODEL --plugin hybridcache` with the
cluster tier on, so links move between them), waits until every one answers, then serves the
front (front.py) as a Ray Serve ingress deployment on `--port`: routing, retries, summed
`/v1/cache/stats`, `/metrics` with a `replica` label. Ctrl-C (or SIGTERM) stops the front and
the replicas. See docs/cluster.md.

The cluster secret (docs/security.md): `--secret-file` (or VLLM_HYBRIDCACHE_CLUSTER_SECRET_FILE)
names a file every node holds at that path; without one, a local cluster (no `--address`) gets
a fresh secret in a private folder (0700, the file 0600) that lives as long as the launcher,
and a remote cluster is refused (the launcher cannot hand a secret to other nodes safely).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import requests
from ray import serve

from vllm_hybridcache.cluster.directory import NAMESPACE, DirectoryClient
from vllm_hybridcache.config import SECRET_ENV as SECRET_VARIABLES
from vllm_hybridcache.config import setting_env
from vllm_hybridcache.core.auth import key_from_file, new_secret

from .front import Front
from .owners import OwnerBookActor
from .routing import Policy, Router
from .server_replica import server_replica_actor

logger = logging.getLogger("vllm_hybridcache")

SECRET_ENV = setting_env("cluster_secret_file")
_OWN_ENV = (setting_env("cluster_address"), setting_env("cluster_replica"), SECRET_ENV)


STARTUP_LOG_INTERVAL_S = 15.0  # a line naming the replicas still starting, this often


class LaunchError(RuntimeError):
    """A replica did not come up; the message carries the tail of its log."""


def replica_env() -> dict[str, str]:
    """The launcher's vLLM and plugin settings (VLLM_*), passed to every replica: on a remote
    node the actor does not inherit this process's environment. Variables holding a secret
    (the admin key) are not passed: an actor's arguments sit in Ray's control store, so give
    the replicas the admin key as a file (`admin_key_file`) instead (docs/security.md)."""
    left = sorted(k for k in os.environ if k in SECRET_VARIABLES)
    if left:
        logger.warning("hybridcache cluster: %s not passed to the replicas (a secret never "
                       "travels through Ray); use admin_key_file", ", ".join(left))
    return {k: v for k, v in os.environ.items()
            if k.startswith("VLLM_") and k not in _OWN_ENV and k not in SECRET_VARIABLES}


class Cluster:
    """N replicas placed by Ray and the front over them, a Ray Serve ingress deployment (see
    the module docstring)."""

    def __init__(self, model: str, replicas: int = 2, serve_args: Sequence[str] = (),
                 cpus_per_replica: float = 1, gpus_per_replica: float = 0,
                 startup_timeout_s: float = 900.0, plugin: bool = True,
                 cluster_tier: bool = True, secret_file: str | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if not ray.is_initialized():
            raise RuntimeError("join a Ray cluster first (join_ray)")
        self._secret_dir: Path | None = None
        self.secret_file = secret_file or self._local_secret()
        self.directory = DirectoryClient(key_from_file(self.secret_file, "cluster"))
        ray.get(self.directory.call("stats"), timeout=60)
        Actor = server_replica_actor(cpus_per_replica, gpus_per_replica)
        env = {**replica_env(), SECRET_ENV: self.secret_file}
        self.actors: dict[str, Any] = {
            f"r{i}": Actor.remote(f"r{i}", model, list(serve_args), env, plugin, cluster_tier)
            for i in range(replicas)}
        self.endpoints = dict(ray.get([a.endpoint.remote() for a in self.actors.values()]))
        self.url: str | None = None
        self.book: Any = None  # the front's owners, kept across front restarts (owners.py)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float, interval_s: float = STARTUP_LOG_INTERVAL_S,
                    poll_s: float = 1.0) -> None:
        """Wait until every replica answers /health. A replica's start-up (loading weights,
        hashing them for the fingerprint on a first start, compiling) can take minutes: a bar
        on a terminal, else a log line every `interval_s` naming the replicas still starting
        (vllm_hybridcache/progress.py)."""
        from vllm_hybridcache.progress import Progress

        pending = dict(self.endpoints)
        deadline = time.monotonic() + timeout_s

        def status() -> str:
            return f"still starting: {', '.join(sorted(pending))}" if pending else "all up"

        with Progress(len(pending), "hybridcache cluster: replicas up", unit="replica",
                      logger=logger, interval_s=interval_s, status=status) as bar:
            while pending:
                for name, url in list(pending.items()):
                    try:
                        if requests.get(url + "/health", timeout=5).status_code == 200:
                            del pending[name]
                            bar.update(1)
                            continue
                    except requests.RequestException:
                        pass
                    if not ray.get(self.actors[name].alive.remote()):
                        tail = ray.get(self.actors[name].log_tail.remote())
                        self.stop()
                        raise LaunchError(f"replica {name} exited during start-up:\n{tail}")
                if pending and time.monotonic() > deadline:
                    self.stop()
                    raise LaunchError(f"replicas {sorted(pending)} not up in {timeout_s:.0f} s")
                if pending:
                    bar.update(0)
                    time.sleep(poll_s)

    def serve_front(self, host: str, port: int, policy: Policy = Policy.AFFINITY,
                    max_imbalance: int = 4, health_interval_s: float = 2.0) -> str:
        """Deploy the front on Ray Serve's HTTP proxy at host:port; its base URL."""
        serve.start(http_options={"host": host, "port": port})
        if self.book is None:
            self.book = OwnerBookActor.remote()
        serve.run(FrontDeployment.bind(self.endpoints, self.actors, policy.value,
                                       max_imbalance, health_interval_s, self.book,
                                       self.secret_file),
                  name=APP_NAME, route_prefix="/")
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.url = f"http://{shown}:{port}"
        return self.url

    def stop(self) -> None:
        """Stop the front and every replica (their engines shut down; links withdrawn)."""
        if self.url is not None:
            try:
                serve.shutdown()
            except Exception as e:  # stopping goes on: the replicas must not outlive us
                logger.warning("hybridcache: Ray Serve shutdown: %s", e)
            self.url = None
        refs = []
        for a in self.actors.values():
            try:
                refs.append(a.stop.remote())
            except ray.exceptions.RayError:
                pass
        for r in refs:
            try:
                ray.get(r, timeout=120)
            except ray.exceptions.RayError:
                pass
        for a in self.actors.values():
            ray.kill(a)
        if self.book is not None:
            ray.kill(self.book)
            self.book = None
        if self._secret_dir is not None:
            shutil.rmtree(self._secret_dir, ignore_errors=True)
            self._secret_dir = None

    def _local_secret(self) -> str:
        """A fresh cluster secret for replicas on this machine only (module docstring)."""
        nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        if len(nodes) > 1:
            raise LaunchError(
                f"the Ray cluster has {len(nodes)} nodes: give every replica the same cluster "
                f"secret with --secret-file (or {SECRET_ENV}), a file that exists at that path "
                "on every node (e.g. `openssl rand -hex 32 > secret; chmod 600 secret`)")
        self._secret_dir = Path(tempfile.mkdtemp(prefix="hybridcache-secret-"))  # 0700
        # gone with the launcher even when the start-up fails before `stop` could run
        atexit.register(shutil.rmtree, self._secret_dir, True)
        path = self._secret_dir / "cluster.secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(new_secret() + b"\n")
        return str(path)


APP_NAME = "hybridcache"


@serve.deployment(num_replicas=1, max_ongoing_requests=4096,
                  ray_actor_options={"num_cpus": 0})
@serve.ingress()
class FrontDeployment:
    """The front (front.py) as Ray Serve's ingress: Serve's proxy owns the port and hands each
    HTTP request to this one replica, which holds the routing state (owners, loads).

    endpoints: replica name -> base URL; actors: replica name -> its Ray actor (liveness);
    book: the OwnerBook actor, where the owners are written behind each answered turn and read
    back when Serve starts this replica again after it died (owners.py).
    """

    def __init__(self, endpoints: dict[str, str], actors: dict[str, Any], policy: str,
                 max_imbalance: int, health_interval_s: float, book: Any = None,
                 secret_file: str | None = None) -> None:
        self.actors = actors
        self.directory = (DirectoryClient(key_from_file(secret_file, "cluster"))
                          if secret_file else None)
        self.book = book
        router = Router(list(endpoints), Policy(policy), max_imbalance,
                        on_owner=self.keep_owner if book is not None else None)
        if book is not None:
            try:
                n = router.load(*ray.get(book.dump.remote(), timeout=60))
                if n:
                    logger.warning("hybridcache front: %d conversation owners taken over", n)
            except ray.exceptions.RayError as e:  # routing by load until the maps fill again
                logger.warning("hybridcache front: owners not read back: %s", e)
        self.front = Front(endpoints, router, self.alive, self.forget,
                           health_interval_s=health_interval_s)

    def keep_owner(self, session: str | None, keys, replica: str) -> None:
        """Write a new owner behind (never waited for)."""
        try:
            self.book.remember.remote(session, list(keys), replica)
        except ray.exceptions.RayError as e:
            logger.warning("hybridcache front: owner not kept: %s", e)

    async def alive(self, name: str) -> bool:
        """Whether the replica's actor and its server process live (a dead actor: False)."""
        try:
            return await asyncio.wait_for(self.actors[name].alive.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return False

    async def forget(self, name: str) -> None:
        """Remove a dead replica's links from the directory."""
        if self.directory is None:
            return
        n = await self.directory.call("forget_owner", name)
        logger.warning("hybridcache: %d links of replica %s left the directory", n, name)

    def __serve_build_asgi_app__(self):
        return self.front.app()


def join_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Join the cluster at `address`, or start a local one (this machine only)."""
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    else:
        ray.init(namespace=NAMESPACE, num_cpus=num_cpus, include_dashboard=False,
                 log_to_driver=False)


def _model_path(model: str, serve_args: list[str]) -> tuple[str, list[str]]:
    """An embedded model's name (vllm-hybridcache list-models) becomes its folder, served
    under its name; anything else is passed to vLLM as it is."""
    from vllm_hybridcache.models.catalog import CATALOG

    if model in CATALOG and not os.path.exists(model):
        from vllm_hybridcache.models import ensure_model

        path = str(ensure_model(model))
        if "--served-model-name" not in serve_args:
            serve_args = [*serve_args, "--served-model-name", model]
        return path, serve_args
    return model, serve_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-hybridcache cluster",
        description="N replicas of MODEL with the plugin and the cluster tier under Ray, one "
                    "OpenAI port. Flags after `--` go to every replica's `vllm serve`.")
    p.add_argument("model", help="checkpoint folder, hub id, or an embedded model's name")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (host:port or auto); default: a local one")
    p.add_argument("--secret-file", default=os.environ.get(SECRET_ENV) or None,
                   help="the cluster secret's file, at this path on every node (default: "
                        f"${SECRET_ENV}; a local cluster without one gets a fresh secret)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--cpus-per-replica", type=float, default=1)
    p.add_argument("--gpus-per-replica", type=float, default=0)
    p.add_argument("--ray-cpus", type=int, default=None,
                   help="CPUs of the local Ray cluster (default: all)")
    p.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.AFFINITY.value)
    p.add_argument("--max-imbalance", type=int, default=4,
                   help="requests in flight an owner may have beyond the least loaded replica "
                        "before its turns go elsewhere")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--no-cluster-tier", action="store_true",
                   help="each replica keeps a private cache (no links move between them)")
    p.add_argument("--no-plugin", action="store_true",
                   help="stock vLLM replicas (for comparisons; /v1/cache/* then answer 404)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    model, serve_args = _model_path(args.model, serve_args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    join_ray(args.address, args.ray_cpus)
    try:
        cluster = Cluster(model, args.replicas, serve_args, args.cpus_per_replica,
                          args.gpus_per_replica, args.startup_timeout,
                          plugin=not args.no_plugin, cluster_tier=not args.no_cluster_tier,
                          secret_file=args.secret_file)
    except LaunchError as e:
        print(f"vllm-hybridcache cluster: error: {e}", file=sys.stderr)
        ray.shutdown()
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        url = cluster.serve_front(args.host, args.port, Policy(args.policy),
                                  args.max_imbalance)
        print(f"vllm-hybridcache cluster: {len(cluster.actors)} replicas "
              f"({', '.join(f'{n} {u}' for n, u in cluster.endpoints.items())}); "
              f"OpenAI API on {url}", flush=True)
        stop.wait()
    finally:
        cluster.stop()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
