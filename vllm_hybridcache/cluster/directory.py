"""The cluster's link directory: one named Ray actor per cluster secret, keyed by locators, that
answers only callers holding the secret.

Why an actor: Ray already provides a cluster-wide, addressable, single-threaded place to keep a
small table; a replica finds it by name. Each entry names the link's segment, its size, the
replica that published it (its owner) and a reference to the payload object. The reference is
kept inside a list so Ray passes the reference itself rather than the object: holding it here
keeps the payload alive for as long as its owner lives (Ray loses an object with its owner,
which a fetch reports as a lost owner).

What it knows and who may ask (docs/security.md):
- Entries are keyed by *locators* (core/tiers/cluster.py `locator`): keyed digests of
  (fingerprint, domain, digest). The table holds no fingerprint, domain, prompt digest or
  token id; nobody without the cluster secret can tell whose prefix an entry is, or compute
  where a given prefix would be.
- Every call, reads included, goes through `call(body, mac, refs)`: `body` (msgpack: the
  operation, its arguments, the ids of the object refs passed along, a timestamp and a nonce)
  carries a MAC keyed by the directory key (`LinkKey.directory_key`, derived from the cluster
  secret; the actor holds only that key, so it can neither forge a payload nor compute a
  locator). A call whose MAC fails, whose timestamp is more than SKEW_S off, or whose nonce was
  seen is refused (`DirectoryRefused`): a Ray client without the secret can neither publish,
  forget nor enumerate. The directory remembers at most NONCES_MAX nonces; once it had to
  forget one early, calls stamped no later than that one are refused too, so a flood of calls
  never reopens a replay window. The actor's name carries a keyed digest of the secret, so
  clusters with different secrets never share a directory.
- What a member of the Ray cluster can still do (docs/security.md): Ray runs any code
  its members submit, on any node, as the user the replicas run as. The directory key reaches
  the actor as its creation argument, which Ray keeps in its control store; Ray lets any
  caller run a function inside an actor (`__ray_call__`); payloads sit in Ray's object store;
  and a task can read the secret file on its node. So whoever can join the Ray cluster or
  submit to it is trusted with everything: the directory's authentication keeps out the
  replicas of another secret sharing the Ray cluster, and anyone who reaches its RPC without
  being able to run code there; no one without the secret can make a replica accept a
  payload (payload MACs use another key derived from the secret, which no actor holds).
  Keep outsiders out of Ray itself: token authentication and TLS.

End anchors live in a table of their own (a session-exact state never answers a tree lookup),
indexed by the locator of their key block digest (`block_locator`): a lookup does not know an
anchor's length, so it sends the locators at its prompt's block boundaries and gets the
anchors indexed under them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import ray

from vllm_hybridcache.core.auth import LinkKey

DIRECTORY_NAME = "hybridcache-directory"
NAMESPACE = "hybridcache"
SKEW_S = 300.0  # how far a call's timestamp may be from the directory's clock
# nonces of recent calls kept (a replayed call is refused): a window of 2 * SKEW_S holds every
# call of a cluster making up to ~870 calls/s; past it the floor rises (module docstring)
NONCES_MAX = 1 << 19
_PERSON = b"hc-dir-call"

# (parent locator, start, end, nbytes, owner, [payload ref])
Entry = tuple[bytes, int, int, int, str, list[Any]]


class DirectoryRefused(Exception):
    """A directory call without a valid MAC, too old, or replayed."""


class ClusterDirectory:
    """The table itself (plain Python: unit-testable without Ray), keyed by locators."""

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        # end anchors: locator -> (block locator, end, nbytes, owner, [payload ref]), and
        # block locator -> the anchors' locators
        self._anchors: dict[bytes, tuple[bytes, int, int, str, list[Any]]] = {}
        self._blocks: dict[bytes, set[bytes]] = {}

    def publish(self, locator: bytes, parent: bytes, start: int, end: int, nbytes: int,
                owner: str, ref: list[Any]) -> None:
        self._entries[locator] = (parent, start, end, nbytes, owner, ref)

    def locate(self, locators: list[bytes]) -> list[tuple[bytes, bytes, int, int, int, str,
                                                          list[Any]]]:
        return [(loc, *self._entries[loc]) for loc in locators if loc in self._entries]

    def forget(self, locators: list[bytes], owner: str | None = None) -> int:
        """Remove entries (only `owner`'s when given: a replica withdrawing its own links
        never removes a newer copy another replica published)."""
        n = 0
        for loc in locators:
            e = self._entries.get(loc)
            if e is not None and (owner is None or e[4] == owner):
                del self._entries[loc]
                n += 1
        return n

    def forget_owner(self, owner: str) -> int:
        """Remove every entry (tree links and end anchors) of a replica that is gone."""
        gone = [k for k, e in self._entries.items() if e[4] == owner]
        for k in gone:
            del self._entries[k]
        anchors = [k for k, e in self._anchors.items() if e[3] == owner]
        self.forget_anchors(anchors)
        return len(gone) + len(anchors)

    # ------------------------------------------------------------------ end anchors
    def publish_anchor(self, locator: bytes, block: bytes, end: int, nbytes: int, owner: str,
                       ref: list[Any]) -> None:
        self.forget_anchors([locator])
        self._anchors[locator] = (block, end, nbytes, owner, ref)
        self._blocks.setdefault(block, set()).add(locator)

    def locate_anchors(self, blocks: list[bytes], limit: int
                       ) -> list[tuple[bytes, bytes, int, int, int, str, list[Any]]]:
        """Anchors of at most `limit` tokens indexed under one of `blocks`, in the shape of
        `locate`'s entries (roots: no parent, start 0)."""
        out = []
        for b in blocks:
            for loc in self._blocks.get(b, ()):
                _, end, nbytes, owner, ref = self._anchors[loc]
                if end <= limit:
                    out.append((loc, b"", 0, end, nbytes, owner, ref))
        return out

    def forget_anchors(self, locators: list[bytes], owner: str | None = None) -> int:
        """Remove anchors (only `owner`'s when given)."""
        n = 0
        for loc in locators:
            e = self._anchors.get(loc)
            if e is None or (owner is not None and e[3] != owner):
                continue
            del self._anchors[loc]
            ds = self._blocks.get(e[0])
            if ds is not None:
                ds.discard(loc)
                if not ds:
                    del self._blocks[e[0]]
            n += 1
        return n

    def anchors_of(self, owner: str) -> list[tuple[bytes, tuple[bytes, int, int, list[Any]]]]:
        """Every end anchor of one replica (locator, (block locator, end, nbytes, [ref]))."""
        return [(k, (e[0], e[1], e[2], e[4])) for k, e in self._anchors.items()
                if e[3] == owner]

    def entries_of(self, owner: str) -> list[tuple[bytes, tuple[bytes, int, int, int, list[Any]]]]:
        """Every entry of one replica (locator, (parent locator, start, end, nbytes, [ref]))."""
        return [(k, (e[0], e[1], e[2], e[3], e[5])) for k, e in self._entries.items()
                if e[4] == owner]

    def stats(self) -> dict[str, dict[str, int]]:
        """Entries (tree links, end anchors) and payload bytes per owner."""
        out: dict[str, dict[str, int]] = {}
        for e in self._entries.values():
            s = out.setdefault(e[4], {"links": 0, "anchors": 0, "bytes": 0})
            s["links"] += 1
            s["bytes"] += e[3]
        for a in self._anchors.values():
            s = out.setdefault(a[3], {"links": 0, "anchors": 0, "bytes": 0})
            s["anchors"] += 1
            s["bytes"] += a[2]
        return out


OPERATIONS = frozenset({"publish", "locate", "forget", "forget_owner", "publish_anchor",
                        "locate_anchors", "forget_anchors", "anchors_of", "entries_of",
                        "stats"})
_REF_ARG = {"publish", "publish_anchor"}  # calls whose last argument is the payload ref list


def _ref_ids(refs: list[Any]) -> list[bytes]:
    return [r.binary() if hasattr(r, "binary") else bytes(r) for r in refs]


def sign_call(key: bytes, op: str, args: list[Any], refs: list[Any],
              clock: Callable[[], float] = time.time) -> tuple[bytes, bytes]:
    """The (body, mac) of a directory call (see the module docstring)."""
    body = msgspec.msgpack.encode([op, args, _ref_ids(refs), float(clock()), os.urandom(16)])
    return body, hashlib.blake2b(body, key=key, digest_size=32, person=_PERSON).digest()


class _ReplayGuard:
    """Remembers the nonces of recent calls while a replay of them could pass the timestamp
    check. A plain object held by the actor, so none of this is an actor method (Ray makes
    every method of an actor class callable by any member, underscored ones included)."""

    def __init__(self) -> None:
        # nonce -> (arrival, the call's timestamp) of recent calls, in arrival order
        self.nonces: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        # calls stamped at or before it are refused: a nonce forgotten to keep the set within
        # NONCES_MAX belonged to a call stamped no later, so its replay is still caught
        self.floor = float("-inf")

    def admit(self, nonce: bytes, now: float, stamp: float) -> str | None:
        """None when the call is new (and remember it), else why it is refused. A nonce that
        arrived more than 2 * SKEW_S ago is dropped (its stamp is more than SKEW_S old by
        now); past NONCES_MAX the oldest goes and raises the floor to its stamp."""
        if nonce in self.nonces:
            return "replayed"
        if stamp <= self.floor:
            return "stamped before calls it no longer remembers (a replay?)"
        self.nonces[nonce] = (now, stamp)
        while self.nonces:
            arrived, stamped = next(iter(self.nonces.values()))
            if now - arrived > 2 * SKEW_S:
                self.nonces.popitem(last=False)
            elif len(self.nonces) > NONCES_MAX:
                self.nonces.popitem(last=False)
                self.floor = max(self.floor, stamped)
            else:
                break
        return None


def _refused(why: str) -> DirectoryRefused:
    return DirectoryRefused(f"directory call refused: {why}")


class AuthenticatedDirectory:
    """A ClusterDirectory that answers only `call`s MACed with its key (module docstring).
    `call` is its one method: its state (the table, the replay guard) lives in attributes."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        self._key = bytes(key)
        self._clock = clock
        self._table = ClusterDirectory()
        self._guard = _ReplayGuard()
        self.refused = 0

    def call(self, body: bytes, mac: bytes, refs: list[Any]) -> Any:
        want = hashlib.blake2b(body, key=self._key, digest_size=32, person=_PERSON).digest()
        why = None
        if not hmac.compare_digest(want, mac):
            why = "its MAC does not match this directory's key"
        else:
            try:
                op, args, ref_ids, stamp, nonce = msgspec.msgpack.decode(body)
            except (msgspec.DecodeError, ValueError, TypeError):
                op = args = ref_ids = stamp = nonce = None
                why = "malformed"
            now = self._clock()
            if why is None and (op not in OPERATIONS or not isinstance(args, list)
                                or not isinstance(stamp, (int, float))
                                or not isinstance(nonce, bytes)
                                or ref_ids != _ref_ids(refs) or abs(now - float(stamp)) > SKEW_S):
                why = "malformed, stale or with other object refs"
            if why is None:
                why = self._guard.admit(nonce, now, float(stamp))
        if why is not None:
            self.refused += 1
            raise _refused(why)
        if op in _REF_ARG:
            args = [*args, list(refs)]
        return getattr(self._table, op)(*args)


DirectoryActor = ray.remote(num_cpus=0, max_restarts=0)(AuthenticatedDirectory)


class DirectoryClient:
    """A caller of the directory that holds the cluster secret (replica, front, launcher).

    `call(op, *args, refs=...)` returns an ObjectRef of the answer (`ray.get` it, or not for a
    fire-and-forget call); a refused call raises DirectoryRefused on `ray.get`.
    """

    def __init__(self, key: LinkKey) -> None:
        self.key = key
        self.name = f"{DIRECTORY_NAME}-{key.name(b'directory-actor', size=8)}"
        self._handle: Any = None
        self._cluster: str | None = None  # the Ray connection the handle belongs to

    def handle(self) -> Any:
        """The cluster's directory actor for this secret, created by the first replica that
        asks (detached, so it outlives that replica; it goes with the cluster). A handle is
        only good in the Ray cluster it came from: a process that joined another one since
        (a restarted cluster) looks the actor up again."""
        ctx = ray.get_runtime_context()  # a new connection is a new job, even to one cluster
        cluster = f"{ctx.gcs_address}/{ctx.get_job_id()}"
        if self._handle is None or self._cluster != cluster:
            self._cluster = cluster
            self._handle = DirectoryActor.options(
                name=self.name, namespace=NAMESPACE, get_if_exists=True,
                lifetime="detached").remote(self.key.directory_key)
        return self._handle

    def call(self, op: str, *args: Any, refs: list[Any] | None = None) -> Any:
        refs = list(refs or [])
        body, mac = sign_call(self.key.directory_key, op, list(args), refs)
        return self.handle().call.remote(body, mac, refs)
