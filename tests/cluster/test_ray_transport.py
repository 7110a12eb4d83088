"""The Ray transport on a local Ray (one small node): the directory actor, payloads published by
one process and fetched by another, lookups that never wait, and a dead owner counted as such.
The cluster tier runs over it exactly as over the in-process fake (test_cluster_tier.py).

And its trust boundaries (issue 29, docs/security.md): the directory answers only
callers that hold the cluster secret, a replica of another secret shares nothing with this
cluster's replicas (neither way), and the directory holds locators, never a fingerprint,
domain or prompt digest."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray  # the cluster extra: installed by make env

from tests.cluster.conftest import wait_owner_dead
from tests.cluster.forgery import Ghost
from tests.keys import CLUSTER_KEY, CLUSTER_SECRET_FILE, write_key_file
from vllm_hybridcache.cluster import DirectoryClient, DirectoryRefused, RayTransport
from vllm_hybridcache.cluster.directory import NAMESPACE, OPERATIONS, sign_call
from vllm_hybridcache.cluster.engine import Publisher as EnginePublisher
from vllm_hybridcache.core.auth import key_from_file
from vllm_hybridcache.core.keys import make_domain
from vllm_hybridcache.core.tiers.cluster import (
    ClusterMiss,
    ClusterTarget,
    anchor_block,
    block_locator,
    locator,
)

from .fakes import DOM, FP, PROMPT, FakeCluster, Replica

DIRECTORY = DirectoryClient(CLUSTER_KEY)
SECRET = str(CLUSTER_SECRET_FILE)


@pytest.fixture(scope="module")
def local_ray():
    """One local node: 1 CPU, a 128 MiB object store, no dashboard; shut down after."""
    ctx = ray.init(num_cpus=1, object_store_memory=128 << 20, include_dashboard=False,
                   namespace="hybridcache", log_to_driver=False)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


def _poll(p, n: int = 2000):
    for _ in range(n):
        if p.done():
            return p.result()
        time.sleep(0.005)
    raise AssertionError("no answer")


def ask(op: str, *args, client: DirectoryClient = DIRECTORY):
    """A directory call's answer (the tests hold the secret)."""
    return ray.get(client.call(op, *args), timeout=60)


def _locators(keys, cuts=(64, 128, 256), key=CLUSTER_KEY, fp: bytes = FP,
              dom: bytes = DOM) -> list[bytes]:
    return [locator(key, fp, dom, keys.digest(c)) for c in cuts]


def _published_by(a: Replica) -> list[tuple]:
    """A's links as publish() arguments (the worker's job), via the fake cluster of `a`."""
    c = a.transport.c
    return [(loc, e.parent_locator, e.start, e.end, c.objects[e.handle])
            for loc, e in c.entries.items()]


def _fresh_directory() -> None:
    ask("forget_owner", "pub")


def _wait_listed(owner: str, what: str, n: int, client: DirectoryClient = DIRECTORY) -> None:
    """Until the directory lists `n` `what` ("links", "anchors") of `owner`: a publication
    reaches it fire-and-forget."""
    for _ in range(1200):
        if ask("stats", client=client).get(owner, {}).get(what) == n:
            return
        time.sleep(0.05)
    assert ask("stats", client=client).get(owner, {}).get(what) == n


def test_directory_publish_locate_fetch_across_processes(local_ray, tmp_path, layout):
    a = Replica(FakeCluster(), "a", layout, tmp_path)
    a.capture(PROMPT)
    _fresh_directory()
    pub = Ghost.remote(SECRET, "pub")
    ray.get(pub.publish.remote(_published_by(a)))
    _wait_listed("pub", "links", 3)
    t = RayTransport(local_ray, CLUSTER_KEY, owner="me")
    keys = a.tree.keys(PROMPT)
    entries = _poll(t.locate(_locators(keys)))
    assert sorted(e.end for e in entries) == [64, 128, 256]
    assert {e.owner for e in entries} == {"pub"}
    # the fingerprint is part of the locator: another engine's lookup finds nothing
    assert _poll(t.locate(_locators(keys, (64,), fp=b"G" * 32))) == []
    payloads = _poll(t.fetch(sorted(entries, key=lambda e: e.end)))
    assert [len(p) for p in payloads] == [e.nbytes for e in sorted(entries, key=lambda e: e.end)]
    ray.kill(pub)


def _published(tmp_path, layout):
    a = Replica(FakeCluster(), "a", layout, tmp_path)
    a.capture(PROMPT)
    expected = a.restore_bytes(a.tree.lookup(a.tree.keys(PROMPT), DOM).plan.chain)
    _fresh_directory()
    pub = Ghost.remote(SECRET, "pub")
    items = _published_by(a)
    ray.get(pub.publish.remote(items))
    _wait_listed("pub", "links", len(items))
    return pub, expected


def _lookup_until_answered(r: Replica, n: int = 12000):
    keys = r.cache.keys(PROMPT)
    res = r.cache.lookup(keys, DOM, len(PROMPT) - 1)  # "not yet", or a hit if Ray was quick
    for _ in range(n):  # the fetch runs in the background: up to a minute on a loaded box
        res = r.cache.lookup(keys, DOM, len(PROMPT) - 1)
        if not res.pending:
            break
        time.sleep(0.005)
    return res


def test_cluster_tier_over_ray_restores_byte_for_byte(local_ray, tmp_path, layout):
    pub, expected = _published(tmp_path, layout)
    b = Replica(FakeCluster(), "b", layout, tmp_path)
    b.tier.transport = RayTransport(local_ray, CLUSTER_KEY, owner="b")
    res = _lookup_until_answered(b)
    assert res.hit and res.tier == "cluster" and res.tokens == 256
    assert b.serve(res) == expected
    ray.kill(pub)


def test_owner_killed_before_the_fetch_is_a_counted_miss(local_ray, tmp_path, layout):
    """The replica that published the links dies before anyone fetched them: the lookup is an
    owner_lost (or object_lost) miss, nothing is staged, and the entries leave the directory."""
    pub, _ = _published(tmp_path, layout)
    c = Replica(FakeCluster(), "c", layout, tmp_path)
    c.tier.transport = RayTransport(local_ray, CLUSTER_KEY, owner="c")
    probe = ray.get(pub.probe.remote())[0]
    ray.kill(pub, no_restart=True)
    wait_owner_dead(probe)
    res = _lookup_until_answered(c, 4000)
    assert not res.hit
    st = c.tier.stats().misses
    assert st.get(ClusterMiss.OWNER_LOST) == 1, st
    for _ in range(200):  # forget is fire and forget
        if ask("stats").get("pub") is None:
            break
        time.sleep(0.05)
    assert ask("stats").get("pub") is None  # its entries left the directory
    assert not np.any([c.store.has(i) for i in range(1, 20)])


def test_the_owner_book_keeps_the_fronts_owners_in_a_ray_actor(local_ray):
    """What a restarted front reads back: owners written fire-and-forget, dumped in order."""
    from vllm_hybridcache.fleet.owners import OwnerBookActor
    from vllm_hybridcache.fleet.routing import Outcome, Router

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
    a = Replica(FakeCluster(), "a", layout, tmp_path, anchors=True)
    a.capture_anchor(PROMPT[:300])
    loc, (block, e) = next(iter(a.transport.c.anchors.items()))
    expected = a.restore_bytes(a.cache.lookup(a.cache.keys(PROMPT), DOM, 399).plan.chain)
    _fresh_directory()
    pub = Ghost.remote(SECRET, "pub")
    item = (loc, block, e.end, a.transport.c.objects[e.handle])
    assert ray.get(pub.publish_anchors.remote([item])) == 1
    _wait_listed("pub", "anchors", 1)
    b = Replica(FakeCluster(), "b", layout, tmp_path, anchors=True)
    b.tier.transport = b.remote_anchors.transport = RayTransport(local_ray, CLUSTER_KEY,
                                                                 owner="b")
    res = _lookup_until_answered(b)
    assert res.hit and (res.tier, res.kind) == ("cluster", "anchor") and res.tokens == 300
    assert b.serve(res) == expected
    b.tier.transport.forget_anchors([loc], owner="b")  # not b's: stays
    keys = b.cache.keys(PROMPT)
    blocks = [block_locator(CLUSTER_KEY, FP, DOM, keys.digest(p)) for p in range(64, 400, 64)]
    assert block == blocks[anchor_block(300) // 64 - 1]
    assert len(_poll(b.tier.transport.locate_anchors(blocks, 399))) == 1
    ray.get(pub.withdraw_anchor.remote(loc))
    for _ in range(1200):
        if not _poll(b.tier.transport.locate_anchors(blocks, 399)):
            break
        time.sleep(0.05)
    assert _poll(b.tier.transport.locate_anchors(blocks, 399)) == []
    ray.kill(pub)


# ---------------------------------------------------------------------- trust boundaries
def _other_secret(tmp_path) -> tuple[str, object]:
    path = write_key_file(tmp_path / "other.secret")
    return str(path), key_from_file(path, "cluster")


def _drop_directory(client: DirectoryClient) -> None:
    try:
        ray.kill(ray.get_actor(client.name, namespace=NAMESPACE))
    except ValueError:
        pass


def test_a_replica_of_another_secret_neither_publishes_to_nor_fetches_from_the_others(
        local_ray, tmp_path, layout):
    """Two replicas on one Ray cluster with different secret files: the intruder's links
    (the same prompt, fingerprint and domain) are never located by this cluster's replicas,
    not even at the intruder's own locators, and the intruder locates nothing of theirs, not
    even at this cluster's locators (which it could not compute). Each side still finds its
    own (positive control). Before issue 29 one directory served every replica on the Ray
    cluster, keyed by (fingerprint, domain, digest): each found the other's links."""
    wrong_file, wrong_key = _other_secret(tmp_path)
    wrong_dir = DirectoryClient(wrong_key)
    assert wrong_dir.name != DIRECTORY.name  # one directory actor per secret
    try:
        pub, expected = _published(tmp_path, layout)
        intruder_src = Replica(FakeCluster(), "i", layout, tmp_path, key=wrong_key)
        intruder_src.capture(PROMPT, seed=7)
        theirs_expected = intruder_src.restore_bytes(
            intruder_src.tree.lookup(intruder_src.tree.keys(PROMPT), DOM).plan.chain)
        assert theirs_expected != expected
        intruder = Ghost.remote(wrong_file, "intruder")
        ray.get(intruder.publish.remote(_published_by(intruder_src)))
        _wait_listed("intruder", "links", 3, client=wrong_dir)
        keys = intruder_src.tree.keys(PROMPT)
        mine, theirs = _locators(keys), _locators(keys, key=wrong_key)
        assert not set(mine) & set(theirs)

        right = RayTransport(local_ray, CLUSTER_KEY, owner="right")
        assert {e.owner for e in _poll(right.locate(mine))} == {"pub"}
        assert _poll(right.locate(theirs)) == []
        assert "intruder" not in ask("stats")
        wrong = RayTransport(local_ray, wrong_key, owner="wrong")
        assert _poll(wrong.locate(mine)) == []
        assert {e.owner for e in _poll(wrong.locate(theirs))} == {"intruder"}
        assert "pub" not in ask("stats", client=wrong_dir)

        # the cluster tier over each restores its own side's bytes, never the other's
        b = Replica(FakeCluster(), "b", layout, tmp_path)
        b.tier.transport = right
        res = _lookup_until_answered(b)
        assert res.hit and res.tokens == 256 and b.serve(res) == expected
        z = Replica(FakeCluster(), "z", layout, tmp_path, key=wrong_key)
        z.tier.transport = wrong
        res = _lookup_until_answered(z)
        assert res.hit and res.tokens == 256 and z.serve(res) == theirs_expected
        ray.kill(intruder)
        ray.kill(pub)
    finally:
        _drop_directory(wrong_dir)


def test_a_caller_without_the_secret_is_refused_by_the_directory(local_ray, tmp_path, layout):
    """The directory actor answers only calls MACed under the secret's directory key: a
    client of another secret aimed at this cluster's actor (by its name, which a Ray member
    can list) can neither enumerate, publish nor forget; a bad MAC, a replayed call and a
    genuine call carrying other object refs are refused; the table's methods are not actor
    methods at all. Before issue 29 the actor's methods (locate, entries_of, forget_owner,
    ...) answered any Ray client."""
    pub, _ = _published(tmp_path, layout)
    _, wrong_key = _other_secret(tmp_path)
    intruder = DirectoryClient(wrong_key)
    intruder.name = DIRECTORY.name  # this cluster's actor, not one of its own
    handle = intruder.handle()
    refused_before = ray.get(handle.__ray_call__.remote(lambda d: d.refused))
    for op, args in (("entries_of", ("pub",)), ("stats", ()), ("forget_owner", ("pub",)),
                     ("locate", ([b"x" * 16],))):
        with pytest.raises(DirectoryRefused):
            ask(op, *args, client=intruder)
    ref = ray.put(b"forged payload")
    with pytest.raises(DirectoryRefused):
        ray.get(intruder.call("publish", b"l" * 16, b"", 0, 64, 14, "intruder", refs=[ref]),
                timeout=60)
    with pytest.raises(DirectoryRefused):
        ray.get(handle.call.remote(b"\x93\xa5stats\x90\x90", b"\0" * 32, []), timeout=60)
    for op in OPERATIONS:
        with pytest.raises(AttributeError):
            getattr(handle, op)
    body, mac = sign_call(CLUSTER_KEY.directory_key, "entries_of", ["pub"], [])
    assert len(ray.get(handle.call.remote(body, mac, []), timeout=60)) == 3
    with pytest.raises(DirectoryRefused):  # the same body and MAC again
        ray.get(handle.call.remote(body, mac, []), timeout=60)
    a = Replica(FakeCluster(), "a", layout, tmp_path)
    a.capture(PROMPT)
    loc, e = next(iter(a.transport.c.entries.items()))
    genuine = ray.put(a.transport.c.objects[e.handle])
    body, mac = sign_call(CLUSTER_KEY.directory_key, "publish",
                          [loc, e.parent_locator, e.start, e.end, e.nbytes, "x"], [genuine])
    with pytest.raises(DirectoryRefused):  # a signed publication with its payload swapped
        ray.get(handle.call.remote(body, mac, [ref]), timeout=60)
    assert ray.get(handle.__ray_call__.remote(lambda d: d.refused)) == refused_before + 8
    st = ask("stats")  # nothing refused changed the table
    assert st["pub"]["links"] == 3 and "intruder" not in st and "x" not in st
    ray.kill(pub)


def test_the_directory_holds_locators_never_fingerprints_domains_or_digests(
        local_ray, tmp_path, layout):
    """What the worker's Publisher lists (tree links and an end anchor, through the real
    RayTransport): every key is a locator, a keyed digest that differs from the prompt
    digest it stands for; no fingerprint, domain or digest appears in any field; the locators
    of two domains (two tenants) for the same digest differ, as do those of two secrets.
    Before issue 29 the table was keyed by (fingerprint, domain, digest) in the clear."""
    a = Replica(FakeCluster(), "a", layout, tmp_path, anchors=True)
    keys = a.tree.keys(PROMPT)
    jobs, parts = [], []
    for c in (64, 128, 256):
        r = a.cache.reserve("tree", keys, c, DOM)
        a.store.allocate(r.link_id, layout.view_rows(r.start, r.end))
        a.store.seal(r.link_id)
        assert a.cache.commit(r.addr)
        jobs.append(a.tier.publish_job(a.tree.link_record(r.link_id)))
    r = a.cache.reserve("anchor", a.cache.keys(PROMPT[:300]), 300, DOM)
    a.store.allocate(r.link_id, layout.view_rows(0, 300))
    a.store.seal(r.link_id)
    assert a.cache.commit(r.addr)
    jobs.append(a.remote_anchors.anchor_job(r.link_id, keys, DOM, 300))
    assert all(job is not None for job in jobs)
    for job in jobs:
        b = a.store.buffers(job.link_id)
        parts.append({**b.sections, **b.views})
    publisher = EnginePublisher(ClusterTarget(local_ray, FP, "pub2", SECRET))
    try:
        for job, p in zip(jobs, parts, strict=True):
            publisher.publish(job, p)
        assert publisher.published == 4 and publisher.failed == 0
        _wait_listed("pub2", "links", 3)
        _wait_listed("pub2", "anchors", 1)
        digests = {keys.digest(c) for c in (64, 128, 256, 300)}
        listed = ask("entries_of", "pub2")
        anchors = ask("anchors_of", "pub2")
        assert sorted(loc for loc, _ in listed) == sorted(_locators(keys))
        assert [loc for loc, _ in anchors] == _locators(keys, (300,))
        assert anchors[0][1][0] == block_locator(CLUSTER_KEY, FP, DOM, keys.digest(256))
        secrets = [FP, DOM, *digests]
        for loc, fields in [*listed, *anchors]:
            assert isinstance(loc, bytes) and loc not in digests
            for field in (loc, *[f for f in fields if isinstance(f, bytes)]):
                assert not any(s in field for s in secrets), field
        d = keys.digest(256)
        tenant = make_domain(model="m", cache_salt="tenant-2")
        assert locator(CLUSTER_KEY, FP, DOM, d) != locator(CLUSTER_KEY, FP, tenant, d)
        assert locator(CLUSTER_KEY, FP, DOM, d) != block_locator(CLUSTER_KEY, FP, DOM, d)
        assert locator(CLUSTER_KEY, FP, DOM, d) != locator(key_from_file(
            _other_secret(tmp_path)[0], "cluster"), FP, DOM, d)
    finally:
        publisher.close()
    assert "pub2" not in ask("stats")  # a clean shutdown withdraws every link


def test_a_process_joins_the_cluster_before_its_first_put(monkeypatch):
    """A worker's first publication connects to `cluster_address` before it puts the
    payload into an object store: a `ray.put` in a process not yet connected lets Ray pick
    (or start) a cluster of its own, whose objects no other replica can fetch. (f9c05b0 put
    first and joined on the directory call after.)"""
    import vllm_hybridcache.cluster.transport as transport

    calls: list[str] = []
    monkeypatch.setattr(transport, "connect", lambda address: calls.append(f"join {address}"))
    monkeypatch.setattr(transport.ray, "put", lambda payload: calls.append("put") or "ref")
    monkeypatch.setattr(DirectoryClient, "call",
                        lambda self, op, *args, refs=None: calls.append(op))
    t = RayTransport("head:6379", CLUSTER_KEY, owner="w")
    t.publish(b"l" * 16, b"", 0, 64, b"payload")
    t.publish_anchor(b"m" * 16, b"b" * 16, 64, b"payload")
    assert calls == ["join head:6379", "put", "publish", "put", "publish_anchor"]
