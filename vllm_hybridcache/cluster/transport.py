"""RayTransport: the cluster tier's ClusterTransport (core/tiers/cluster.py) on Ray.

Every directory call is signed with the cluster secret (directory.py `DirectoryClient`); the
arguments are locators (core/tiers/cluster.py), never fingerprints, domains or digests.

Scheduler side (EngineCore process): `locate` asks the directory actor and `fetch` pulls the
payload objects to this node, both without waiting: each returns a Pending whose `done` polls
Ray with a zero timeout (`ray.wait(..., timeout=0, fetch_local=True)`), so the scheduler loop
never blocks on the network. Worker side: `publish` puts a payload into the object store (this
process owns it) and registers it; `withdraw` removes it when the link leaves the worker's
store. End anchors have their own calls (`locate_anchors`, `publish_anchor`, ...: the
directory keeps them apart). Ray errors become ClusterError reasons: a dead owner
`owner_lost`, a lost object `object_lost`, a refused call `unauthenticated`, anything else
`unreachable`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import ray
import ray.exceptions as rex

from vllm_hybridcache.core.auth import LinkKey
from vllm_hybridcache.core.tiers.cluster import ClusterError, ClusterMiss, RemoteEntry

from .directory import NAMESPACE, DirectoryClient, DirectoryRefused

logger = logging.getLogger("vllm_hybridcache")


def connect(address: str) -> None:
    """Join the Ray cluster at `address` as a driver of namespace `hybridcache` (no-op when
    this process is connected already)."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                 configure_logging=False)


def _reason(e: BaseException) -> ClusterMiss:
    if isinstance(e, DirectoryRefused):
        return ClusterMiss.UNAUTHENTICATED
    if isinstance(e, rex.OwnerDiedError):
        return ClusterMiss.OWNER_LOST
    if isinstance(e, (rex.ObjectLostError, rex.ObjectFetchTimedOutError,
                      rex.ReferenceCountingAssertionError)):
        return ClusterMiss.OBJECT_LOST
    if isinstance(e, rex.GetTimeoutError):
        return ClusterMiss.TIMEOUT
    return ClusterMiss.UNREACHABLE


class _Pending:
    """Refs whose values arrive in the background; `done` never waits."""

    def __init__(self, refs: list[Any], convert) -> None:
        self._refs = refs
        self._convert = convert
        self._ready = False

    def done(self) -> bool:
        if not self._ready:
            ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0,
                                fetch_local=True)
            self._ready = len(ready) == len(self._refs)
        return self._ready

    def result(self) -> Any:
        try:
            vals = ray.get(self._refs, timeout=0)
        except (rex.RayError, DirectoryRefused) as e:
            raise ClusterError(_reason(e), f"{type(e).__name__}: {e}") from e
        try:  # the directory's answers carry no MAC: one of another shape is a miss
            return self._convert(vals)
        except (TypeError, ValueError, IndexError, KeyError) as e:
            raise ClusterError(ClusterMiss.VERIFY_FAILED,
                               f"an answer of an unexpected shape: {type(e).__name__}") from e


class _Failed:
    def __init__(self, err: ClusterError) -> None:
        self._err = err

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        raise self._err


def _entries(vals: list[Any]) -> list[RemoteEntry]:
    out = []
    for loc, parent, start, end, nbytes, owner, h in vals[0]:
        if not (isinstance(loc, bytes) and isinstance(parent, bytes) and isinstance(owner, str)
                and all(isinstance(x, int) and x >= 0 for x in (start, end, nbytes))
                and start < end and isinstance(h, list) and len(h) == 1):
            raise ValueError("a malformed directory entry")
        out.append(RemoteEntry(loc, parent, start, end, nbytes, owner, h[0]))
    return out


class RayTransport:
    """The directory and payload movement of one replica process (see the module docstring).

    key: the cluster secret's LinkKey (signs every directory call);
    owner: this replica's name in the directory (its links are listed under it).
    """

    def __init__(self, address: str, key: LinkKey, owner: str | None = None) -> None:
        self.address = address
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}"
        self._client = DirectoryClient(key)
        self._joined = False
        self._held: dict[bytes, Any] = {}  # published payload refs, by locator
        self._held_anchors: dict[bytes, Any] = {}

    def _join(self) -> None:
        """Join the cluster at `address` (once). Before any Ray call of this process: a
        `ray.put` in a process not yet connected would make Ray start (or find) a cluster of
        its own choosing, whose object store no other replica reads."""
        if not self._joined:
            connect(self.address)
            self._joined = True

    def _call(self, op: str, *args: Any, refs: list[Any] | None = None) -> Any:
        self._join()
        return self._client.call(op, *args, refs=refs)

    def connect(self) -> None:
        """Join the cluster and find (or create) the directory now (start-up checks: a
        directory that refuses this replica's secret raises DirectoryRefused)."""
        ray.get(self._call("stats"), timeout=60)

    # ------------------------------------------------------------------ scheduler side
    def locate(self, locators: Sequence[bytes]) -> Any:
        try:
            ref = self._call("locate", list(locators))
        except rex.RayError as e:
            return _Failed(ClusterError(_reason(e), str(e)))
        return _Pending([ref], _entries)

    def fetch(self, entries: Sequence[RemoteEntry]) -> Any:
        return _Pending([e.handle for e in entries], lambda vals: [bytes(v) for v in vals])

    def forget(self, locators: Sequence[bytes]) -> None:
        try:
            self._call("forget", list(locators), None)
        except rex.RayError as e:
            raise ClusterError(_reason(e), str(e)) from e

    def locate_anchors(self, blocks: Sequence[bytes], limit: int) -> Any:
        try:
            ref = self._call("locate_anchors", list(blocks), int(limit))
        except rex.RayError as e:
            return _Failed(ClusterError(_reason(e), str(e)))
        return _Pending([ref], _entries)

    def forget_anchors(self, locators: Sequence[bytes], owner: str | None = None) -> None:
        """Fire and forget; with `owner`: only that replica's anchors, and wait for the answer
        (a clear returns only once what it cleared is no longer located)."""
        try:
            ref = self._call("forget_anchors", list(locators), owner)
            if owner is not None:
                ray.get(ref, timeout=30)
        except (rex.RayError, DirectoryRefused) as e:
            raise ClusterError(_reason(e), str(e)) from e

    # ------------------------------------------------------------------ worker side
    def publish(self, locator: bytes, parent: bytes, start: int, end: int,
                payload: bytes) -> None:
        """Put a payload in the object store (owned by this process) and list it."""
        self._join()
        ref = ray.put(payload)
        self._held[locator] = ref
        self._call("publish", locator, parent, start, end, len(payload), self.owner, refs=[ref])

    def withdraw(self, locator: bytes) -> None:
        """Stop offering a link (it left this worker's store)."""
        if self._held.pop(locator, None) is not None:
            self._call("forget", [locator], self.owner)

    def publish_anchor(self, locator: bytes, block: bytes, end: int, payload: bytes) -> None:
        """Put an end anchor's payload in the object store and list it under `block` (the
        locator of its prefix's digest at `anchor_block(end)`)."""
        self._join()
        ref = ray.put(payload)
        self._held_anchors[locator] = ref
        self._call("publish_anchor", locator, block, end, len(payload), self.owner, refs=[ref])

    def withdraw_anchor(self, locator: bytes) -> None:
        """Stop offering an end anchor (it left this worker's store)."""
        if self._held_anchors.pop(locator, None) is not None:
            self._call("forget_anchors", [locator], self.owner)

    def close(self) -> None:
        """Withdraw every link of this replica (a clean shutdown)."""
        if self._joined and (self._held or self._held_anchors):
            try:
                ray.get(self._call("forget_owner", self.owner), timeout=5)
            except (rex.RayError, DirectoryRefused) as e:
                logger.warning("hybridcache: cluster directory not told of shutdown: %s", e)
        self._held.clear()
        self._held_anchors.clear()
