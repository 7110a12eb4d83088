"""The Ray transport on a local Ray (one small node): the directory actor, payloads published by
one process and fetched by another, lookups that never wait, and a dead owner counted as such.
The cluster tier runs over it exactly as over the in-process fake (test_cluster_tier.py)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import ray  # the cluster extra: installed by make env

from tests.cluster.conftest import wait_owner_dead
from vllm_hybridcache.cluster import RayTransport, directory_handle
from vllm_hybridcache.core.tiers.cluster import ClusterMiss

from .fakes import DOM, FP, PROMPT, Replica


@pytest.fixture(scope="module")
def local_ray():
    """One local node: 1 CPU, a 128 MiB object store, no dashboard; shut down after."""
    ctx = ray.init(num_cpus=1, object_store_memory=128 << 20, include_dashboard=False,
                   namespace="hybridcache", log_to_driver=False)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
class Publisher:
    """Another process that owns payloads (a replica's worker)."""

    def __init__(self, address: str) -> None:
        self.t = RayTransport(address, owner="pub")

    def publish(self, items) -> int:
        for it in items:
            self.t.publish(*it)
        return len(items)

    def publish_anchors(self, items) -> int:
        for it in items:
            self.t.publish_anchor(*it)
        return len(items)

    def withdraw_anchor(self, fp: bytes, dom: bytes, digest: bytes) -> None:
        self.t.withdraw_anchor(fp, dom, digest)

    def pid(self) -> int:
        return os.getpid()

    def probe(self) -> list:
        """An object this process owns, to learn when the cluster knows it is gone."""
        return [ray.put(b"probe")]


def _poll(p, n: int = 2000):
    for _ in range(n):
        if p.done():
            return p.result()
        time.sleep(0.005)
    raise AssertionError("no answer")


def _published_by(address, a: Replica) -> list[tuple]:
    """A's links as publish() arguments (the worker's job), via the fake cluster of `a`."""
    c = a.transport.c
    return [(FP, dom, e.digest, e.parent_digest, e.start, e.end, c.objects[e.handle])
            for (_, dom, _), e in c.entries.items()]


def _fresh_directory():
    d = directory_handle()
    ray.get(d.forget_owner.remote("pub"))
    return d


def test_directory_publish_locate_fetch_across_processes(local_ray, tmp_path, layout):
    from .fakes import FakeCluster
    a = Replica(FakeCluster(), "a", layout, tmp_path)
    a.capture(PROMPT)
    _fresh_directory()
    pub = Publisher.remote(local_ray)
    assert ray.get(pub.publish.remote(_published_by(local_ray, a))) == 3
    t = RayTransport(local_ray, owner="me")
    keys = a.tree.keys(PROMPT)
    entries = _poll(t.locate(FP, DOM, [keys.digest(c) for c in (64, 128, 256)]))
    assert sorted(e.end for e in entries) == [64, 128, 256]
    assert {e.owner for e in entries} == {"pub"}
    assert _poll(t.locate(b"G" * 32, DOM, [keys.digest(64)])) == []  # fingerprint is the key
    payloads = _poll(t.fetch(sorted(entries, key=lambda e: e.end)))
    assert [len(p) for p in payloads] == [e.nbytes for e in sorted(entries, key=lambda e: e.end)]
    ray.kill(pub)


def _published(local_ray, tmp_path, layout):
    from .fakes import FakeCluster
    a = Replica(FakeCluster(), "a", layout, tmp_path)
    a.capture(PROMPT)
    expected = a.restore_bytes(a.tree.lookup(a.tree.keys(PROMPT), DOM).plan.chain)
    d = _fresh_directory()
    pub = Publisher.remote(local_ray)
    n = ray.get(pub.publish.remote(_published_by(local_ray, a)))
    for _ in range(1200):  # a publication reaches the directory fire-and-forget
        if ray.get(d.stats.remote()).get("pub", {}).get("links") == n:
            break
        time.sleep(0.05)
    assert ray.get(d.stats.remote()).get("pub", {}).get("links") == n
    return d, pub, expected


def test_cluster_tier_over_ray_restores_byte_for_byte(local_ray, tmp_path, layout):
    from .fakes import FakeCluster
    _, pub, expected = _published(local_ray, tmp_path, layout)
    b = Replica(FakeCluster(), "b", layout, tmp_path)
    b.tier.transport = RayTransport(local_ray, owner="b")
    keys = b.cache.keys(PROMPT)
    res = b.cache.lookup(keys, DOM, len(PROMPT) - 1)  # "not yet", or a hit if Ray was quick
    for _ in range(12000):  # the fetch runs in the background: up to a minute on a loaded box
        res = b.cache.lookup(keys, DOM, len(PROMPT) - 1)
        if not res.pending:
            break
        time.sleep(0.005)
    assert res.hit and res.tier == "cluster" and res.tokens == 256
    assert b.serve(res) == expected
    ray.kill(pub)


def test_owner_killed_before_the_fetch_is_a_counted_miss(local_ray, tmp_path, layout):
    """The replica that published the links dies before anyone fetched them: the lookup is an
    owner_lost (or object_lost) miss, nothing is staged, and the entries leave the directory."""
    from .fakes import FakeCluster
    d, pub, _ = _published(local_ray, tmp_path, layout)
    c = Replica(FakeCluster(), "c", layout, tmp_path)
    c.tier.transport = RayTransport(local_ray, owner="c")
    probe = ray.get(pub.probe.remote())[0]
    ray.kill(pub, no_restart=True)
    wait_owner_dead(probe)
    keys = c.cache.keys(PROMPT)
    for _ in range(4000):
        res = c.cache.lookup(keys, DOM, len(PROMPT) - 1)
        if not res.pending:
            break
        time.sleep(0.005)
    assert not res.hit
    st = c.tier.stats().misses
    assert st.get(ClusterMiss.OWNER_LOST) == 1, st
    for _ in range(200):  # forget is fire and forget
        if ray.get(d.stats.remote()).get("pub") is None:
            break
        time.sleep(0.05)
    assert ray.get(d.stats.remote()).get("pub") is None  # its entries left the directory
    assert not np.any([c.store.has(i) for i in range(1, 20)])


def test_the_owner_book_keeps_the_fronts_owners_in_a_ray_actor(local_ray):
    """What a restarted front reads back: owners written fire-and-forget, dumped in order."""
    from vllm_hybridcache.cluster.owners import OwnerBookActor
    from vllm_hybridcache.cluster.routing import Outcome, Router

    book = OwnerBookActor.remote()
    try:
        book.remember.remote("s1", [b"k" * 16], "r1")
        book.remember.remote(None, [b"j" * 16, b"k" * 16], "r0")
        sessions, prefixes = ray.get(book.dump.remote(), timeout=60)
        assert sessions == [("s1", "r1")] and prefixes == [(b"j" * 16, "r0"), (b"k" * 16, "r0")]
        r = Router(["r0", "r1"])
        assert r.load(sessions, prefixes) == 3
        assert r.choose("s1").replica == "r1" and r.choose(None, [b"k" * 16]).outcome \
            is Outcome.OWNER
    finally:
        ray.kill(book)


def test_an_end_anchor_over_ray_restores_byte_for_byte_and_leaves_when_withdrawn(
        local_ray, tmp_path, layout):
    """An end anchor published by another process (kind `anchor`, indexed by its key block)
    is located, fetched and restored byte for byte by a replica whose prompt extends it; once
    its owner withdraws it (the anchor left its store) it is no longer located; a clearing
    forget by another replica leaves it listed (only the owner's own clear removes it)."""
    from .fakes import FakeCluster
    a = Replica(FakeCluster(), "a", layout, tmp_path, anchors=True)
    a.capture_anchor(PROMPT[:300])
    (_, dom, digest), (block, e) = next(iter(a.transport.c.anchors.items()))
    expected = a.restore_bytes(a.cache.lookup(a.cache.keys(PROMPT), DOM, 399).plan.chain)
    d = _fresh_directory()
    pub = Publisher.remote(local_ray)
    item = (FP, dom, digest, block, e.end, a.transport.c.objects[e.handle])
    assert ray.get(pub.publish_anchors.remote([item])) == 1
    for _ in range(1200):  # a publication reaches the directory fire-and-forget
        if ray.get(d.stats.remote()).get("pub", {}).get("anchors") == 1:
            break
        time.sleep(0.05)
    b = Replica(FakeCluster(), "b", layout, tmp_path, anchors=True)
    b.tier.transport = b.remote_anchors.transport = RayTransport(local_ray, owner="b")
    keys = b.cache.keys(PROMPT)
    res = b.cache.lookup(keys, DOM, len(PROMPT) - 1)
    for _ in range(12000):
        res = b.cache.lookup(keys, DOM, len(PROMPT) - 1)
        if not res.pending:
            break
        time.sleep(0.005)
    assert res.hit and (res.tier, res.kind) == ("cluster", "anchor") and res.tokens == 300
    assert b.serve(res) == expected
    b.tier.transport.forget_anchors(FP, dom, [digest], owner="b")  # not b's: stays
    blocks = [keys.digest(p) for p in range(64, 400, 64)]
    assert len(_poll(b.tier.transport.locate_anchors(FP, dom, blocks, 399))) == 1
    ray.get(pub.withdraw_anchor.remote(FP, dom, digest))
    for _ in range(1200):
        if not _poll(b.tier.transport.locate_anchors(FP, dom, blocks, 399)):
            break
        time.sleep(0.05)
    assert _poll(b.tier.transport.locate_anchors(FP, dom, blocks, 399)) == []
    ray.kill(pub)
