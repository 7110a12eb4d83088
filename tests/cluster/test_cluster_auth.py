"""The cluster tier's trust boundaries without a Ray cluster (issue 29, docs/security.md):
the directory's call authentication (MAC, timestamp, nonce) on `AuthenticatedDirectory` with an
injected clock, and `open_cluster_tier`'s start-up refusals (no secret, a secret file that must
not be used, a directory that refuses the secret) with fakes for the engine and the transport.

Each fails on the code before issue 29 (1f3f6d5): its directory was a plain actor whose table
methods answered any caller (no `call`, no MAC, no clock), and `open_cluster_tier` started
with no secret at all."""

from __future__ import annotations

import os
from types import SimpleNamespace

import msgspec
import pytest

from tests.cluster.fakes import FP
from tests.core.conftest import SMALL_LAYOUT
from tests.keys import CLUSTER_KEY, CLUSTER_SECRET_FILE, other_key, write_key_file
from vllm_hybridcache.cluster import directory as directory_mod
from vllm_hybridcache.cluster import engine
from vllm_hybridcache.cluster.directory import (
    OPERATIONS,
    SKEW_S,
    AuthenticatedDirectory,
    DirectoryRefused,
    sign_call,
)
from vllm_hybridcache.config import load_settings
from vllm_hybridcache.core import IdSource, SnapshotTree, TreeConfig

KEY = CLUSTER_KEY.directory_key
LOC = b"L" * 16


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def signed(op: str, *args, key: bytes = KEY, refs: tuple = (), at: float | None = None,
           clock: Clock | None = None) -> tuple[bytes, bytes]:
    """A call's (body, mac) stamped `at` (default: `clock`'s time)."""
    stamp = at if at is not None else clock.t
    return sign_call(key, op, list(args), list(refs), clock=lambda: stamp)


@pytest.fixture
def table():
    """An authenticated directory holding one link of owner `a`, and its clock."""
    clock = Clock()
    d = AuthenticatedDirectory(KEY, clock=clock)
    d.call(*signed("publish", LOC, b"", 0, 64, 10, "a", refs=(b"ref-1",), clock=clock),
           [b"ref-1"])
    return d, clock


def test_a_call_without_the_directory_key_is_refused_and_changes_nothing(table):
    """Another secret's key (the same actor name reached by a client of another cluster), a
    bad MAC, a body altered after signing, a genuine body carrying other object refs: each is
    refused and counted, and the table is as it was."""
    d, clock = table
    listed = [(LOC, (b"", 0, 64, 10, [b"ref-1"]))]
    assert d.call(*signed("entries_of", "a", clock=clock), []) == listed
    wrong = other_key("cluster")
    attempts = [
        (*signed("entries_of", "a", key=wrong.directory_key, clock=clock), []),
        (*signed("forget_owner", "a", key=wrong.directory_key, clock=clock), []),
        (signed("stats", clock=clock)[0], bytes(32), []),
        # a key derived from the secret for another purpose is not the directory's either
        (*signed("stats", key=CLUSTER_KEY.mac(b"x"), clock=clock), []),
    ]
    body, mac = signed("forget_owner", "b", clock=clock)
    op, args, ref_ids, stamp, nonce = msgspec.msgpack.decode(body)
    assert args == ["b"]
    attempts.append((msgspec.msgpack.encode([op, ["a"], ref_ids, stamp, nonce]), mac, []))
    body, mac = signed("publish", LOC, b"", 0, 64, 10, "a", refs=(b"ref-1",), clock=clock)
    attempts.append((body, mac, [b"ref-2"]))  # a signed publication, its payload swapped
    for body, mac, refs in attempts:
        with pytest.raises(DirectoryRefused):
            d.call(body, mac, refs)
    assert d.refused == len(attempts)
    assert d.call(*signed("entries_of", "a", clock=clock), []) == listed


def test_a_replayed_or_stale_call_is_refused(table):
    """A call is answered once: the same body and MAC again is refused, even moments later; a
    call stamped more than SKEW_S before or after the directory's clock is refused, one
    within it answered."""
    d, clock = table
    body, mac = signed("entries_of", "a", clock=clock)
    assert d.call(body, mac, [])
    clock.t += 1
    with pytest.raises(DirectoryRefused, match="replayed"):
        d.call(body, mac, [])
    for off in (-SKEW_S - 1, SKEW_S + 1):
        with pytest.raises(DirectoryRefused, match="stale"):
            d.call(*signed("entries_of", "a", at=clock.t + off), [])
    for off in (-SKEW_S + 1, SKEW_S - 1):
        assert d.call(*signed("entries_of", "a", at=clock.t + off), [])
    # a call seen long ago is still refused: its nonce is forgotten only once its stamp is
    # too old to pass anyway
    clock.t += 2 * SKEW_S + 1
    with pytest.raises(DirectoryRefused):
        d.call(body, mac, [])
    assert d.refused == 4


def test_a_flood_of_calls_never_reopens_a_replay_window(table, monkeypatch):
    """The directory keeps at most NONCES_MAX nonces. A flood of calls within seconds pushes
    a call's nonce out while its stamp would still pass: that call replayed is refused all
    the same (calls stamped no later than a forgotten one are refused). Before this fix
    (f9c05b0) the replay was answered: a forget replayed could remove a replica's links."""
    monkeypatch.setattr(directory_mod, "NONCES_MAX", 4)
    d, clock = table
    first = signed("forget_owner", "a", clock=clock)
    clock.t += 0.001
    assert d.call(*first, []) == 1  # a's link removed
    d.call(*signed("publish", LOC, b"", 0, 64, 10, "a", refs=(b"ref-1",), clock=clock),
           [b"ref-1"])  # listed again
    for _ in range(8):
        clock.t += 0.001
        d.call(*signed("stats", clock=clock), [])
    with pytest.raises(DirectoryRefused):
        d.call(*first, [])
    assert d.call(*signed("stats", clock=clock), [])["a"]["links"] == 1
    assert len(d._guard.nonces) <= 4


def test_only_the_table_operations_can_be_called(table):
    """Even MACed, a call names one of the table's operations, never another attribute of
    the table or of the wrapper (its key, its nonces, `call` itself)."""
    d, clock = table
    for op in ("_entries", "_key", "_refuse", "call", "__init__", "__class__"):
        with pytest.raises(DirectoryRefused):
            d.call(*signed(op, clock=clock), [])
    assert {"locate", "entries_of", "forget_owner", "publish"} <= OPERATIONS
    assert not any(op.startswith("_") for op in OPERATIONS)


# ---------------------------------------------------------------------- open_cluster_tier
VLLM_CONFIG = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                              pipeline_parallel_size=1))


class NoTransport:
    """A transport that must never be made (the refusal comes first)."""

    def __init__(self, *args, **kwargs) -> None:
        raise AssertionError("open_cluster_tier reached the transport")


def _fingerprint():
    """The engine's fingerprint as the composition root hands it to the opener."""
    return SimpleNamespace(digest=FP, hex=FP.hex())


def _open(settings):
    tree = SnapshotTree(SMALL_LAYOUT, TreeConfig(budget_bytes=1 << 20, memory_floor_bytes=0))
    return engine.open_cluster_tier(VLLM_CONFIG, SMALL_LAYOUT, {"grid": 256}, settings,
                                    IdSource(), tree, _fingerprint)


def test_open_cluster_tier_refuses_to_start_without_a_secret(monkeypatch):
    """cluster_address without cluster_secret_file: a start-up error naming the setting and
    its variable, before anything joins the Ray cluster."""
    monkeypatch.setattr(engine, "RayTransport", NoTransport)
    settings = load_settings({"cluster_address": "127.0.0.1:6379"}, environ={})
    with pytest.raises(RuntimeError, match="cluster_secret_file") as ei:
        _open(settings)
    assert "VLLM_HYBRIDCACHE_CLUSTER_SECRET_FILE" in str(ei.value)


def test_open_cluster_tier_refuses_a_secret_file_that_must_not_be_used(monkeypatch, tmp_path):
    """A missing file, one others may write, one too short to be a secret: each a start-up
    error naming the file (never a tier running on a secret others may know or change)."""
    monkeypatch.setattr(engine, "RayTransport", NoTransport)
    writable = write_key_file(tmp_path / "group-writable.secret")
    os.chmod(writable, 0o660)
    short = tmp_path / "short.secret"
    short.write_bytes(b"abc\n")
    short.chmod(0o600)
    for path in (tmp_path / "missing.secret", writable, short):
        settings = load_settings({"cluster_address": "127.0.0.1:6379",
                                  "cluster_secret_file": str(path)}, environ={})
        with pytest.raises(RuntimeError, match="not usable") as ei:
            _open(settings)
        assert str(path) in str(ei.value)


def test_open_cluster_tier_refuses_a_directory_that_refuses_its_secret(monkeypatch):
    """The cluster's directory was created under another secret (or this node's clock is
    far off): the replica does not start, and the message names both causes (a replica that
    could neither publish nor find anything would serve on silently)."""
    made = []

    class Refused:
        def __init__(self, address, key, owner=None) -> None:
            made.append((address, key))

        def connect(self) -> None:
            raise DirectoryRefused("directory call refused: its MAC does not match")

    monkeypatch.setattr(engine, "RayTransport", Refused)
    settings = load_settings({"cluster_address": "127.0.0.1:6379",
                              "cluster_secret_file": str(CLUSTER_SECRET_FILE)}, environ={})
    with pytest.raises(RuntimeError, match="refuses this replica's calls") as ei:
        _open(settings)
    assert str(CLUSTER_SECRET_FILE) in str(ei.value) and "clock" in str(ei.value)
    assert [(a, k.key_id) for a, k in made] == [("127.0.0.1:6379", CLUSTER_KEY.key_id)]


def test_the_directory_actor_has_one_method():
    """Ray makes every method of an actor class callable by any member of the cluster,
    underscored ones included: the directory's only method is `call`, so its replay state can
    not be reached around the MAC check."""
    import inspect

    from vllm_hybridcache.cluster.directory import AuthenticatedDirectory

    methods = [n for n, f in inspect.getmembers(AuthenticatedDirectory, inspect.isfunction)
               if not (n.startswith("__") and n.endswith("__"))]
    assert methods == ["call"]
