"""Tenants (issue 29): a domain names its tenant (the tag of the request's `cache_salt`), no
tier tells a tenant whether another tenant holds a prefix, and one tenant's links can be
cleared in every tier while the other tenants' stay, byte for byte.

Every tier of an engine is here without vLLM: RAM tree and end anchors, disk tree and spilled
anchors (files written by a second directory instance, as the writer thread does), and the
cluster tier and its anchors over the fake transport (a peer replica publishes).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from tests.cluster.fakes import Clock, FakeCluster, FakeTransport
from tests.core.link_bytes import fill_seeded, restored_bytes
from tests.keys import CLUSTER_KEY, KEY_FILE, TEST_KEY
from vllm_hybridcache.core import (
    EndAnchors,
    IdSource,
    LinkStore,
    MissReason,
    SnapshotCache,
    SnapshotTree,
    TreeConfig,
    make_domain,
    tenant_of,
    tenant_tag,
)
from vllm_hybridcache.core.disk import LinkDirectory
from vllm_hybridcache.core.disk.spill import SpillBook, anchor_job
from vllm_hybridcache.core.disk.writer import DiskTarget, LinkWriter
from vllm_hybridcache.core.keys import PromptKeys, in_tenant
from vllm_hybridcache.core.linkformat.job import ANCHOR, TREE, WriteJob
from vllm_hybridcache.core.tiers.cluster import (
    ClusterTier,
    anchor_block,
    block_locator,
    link_payload,
    locator,
)
from vllm_hybridcache.core.tiers.cluster_anchors import ClusterAnchors
from vllm_hybridcache.core.tiers.disk import DiskTier
from vllm_hybridcache.core.tiers.disk_anchors import DiskAnchors

FP = b"F" * 32
ENGINE = {"weights": "m@1", "route": "ar", "lora": ""}
A = make_domain(**ENGINE, cache_salt="tenant-a")
B = make_domain(**ENGINE, cache_salt="tenant-b")
A_MTP = make_domain(**{**ENGINE, "route": "mtp"}, cache_salt="tenant-a")  # A, another route
PROMPT = np.arange(5000, 5400, dtype=np.int64)  # what tenant A holds everywhere
UNKNOWN = np.arange(9000, 9400, dtype=np.int64)  # what nobody holds (same length)
CUTS = [64, 128, 256]
ANCHOR_END = 320  # A's end anchors (RAM, disk, cluster) hold PROMPT[:320]


def cuts_of(tokens: np.ndarray) -> list[int]:
    return [c for c in CUTS if c <= len(tokens)]


# ---------------------------------------------------------------- one engine, every tier
class World:
    """Every tier of one engine (scheduler side) and its worker store; a peer replica
    publishes into the same fake cluster directory."""

    def __init__(self, root: Path, layout, cluster: FakeCluster) -> None:
        ids = IdSource()
        self.clock = Clock()
        self.layout = layout
        self.root = root
        self.tree = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 30, memory_floor_bytes=0),
                                 next_id=ids, clock=self.clock)
        self.anchors = EndAnchors(layout, 8, 1 << 30, next_id=ids)
        self.dir = LinkDirectory(root / "disk", FP, 1 << 30, key=TEST_KEY)
        self.dir.open()
        self.disk = DiskTier(layout, self.dir, cuts_of, next_id=ids, promote=self.tree.adopt)
        self.disk_anchors = DiskAnchors(self.disk)
        self.transport = FakeTransport(cluster, "me")
        self.remote = ClusterTier(layout, FP, self.transport, cuts_of, root / "stage", 1 << 30,
                                  10.0, next_id=ids, promote=self.tree.adopt, clock=self.clock,
                                  owner="me", key=CLUSTER_KEY)
        self.remote_anchors = ClusterAnchors(
            self.remote, local=lambda k, d, lim: self.anchors.lookup(k, d, lim).tokens)
        self.cache = SnapshotCache([self.tree, self.disk, self.remote, self.anchors,
                                    self.disk_anchors, self.remote_anchors])
        self.store = LinkStore(layout, pin_memory=False)
        self.cluster = cluster

    def parts(self, link_id: int) -> dict[str, torch.Tensor]:
        b = self.store.buffers(link_id)
        return {**b.sections, **b.views}

    def hold(self, domain: bytes, prompt: np.ndarray, seed: int) -> set[int]:
        """`domain`'s links of `prompt` in every tier: RAM tree links at the cuts and an end
        anchor (committed here, the anchor published to the cluster as the worker would), the
        same as files on disk (written by another directory instance: the writer thread's),
        and a peer replica's publications of both in the cluster directory. Returns the ids
        of the RAM links and anchor."""
        keys = self.cache.keys(prompt)
        gen = torch.Generator().manual_seed(seed)
        writer = LinkDirectory(self.root / "disk", FP, 1 << 30, key=TEST_KEY)
        writer.open()
        peer = FakeTransport(self.cluster, "peer")
        ids = set()
        for c in cuts_of(keys.tokens):
            r = self.cache.reserve("tree", keys, c, domain)
            assert r.link_id is not None
            fill_seeded(self.store, r.link_id, self.layout.view_rows(r.start, r.end), gen)
            assert self.cache.commit(r.addr)
            ids.add(r.link_id)
            rec = self.tree.link_record(r.link_id)
            job = WriteJob(r.link_id, domain, rec.digest, rec.parent_digest, rec.start,
                           rec.end, rec.tokens, self.layout.view_rows(rec.start, rec.end))
            parts = self.parts(r.link_id)
            assert writer.write(domain=domain, digest=job.digest,
                                parent_digest=job.parent_digest, start=job.start, end=job.end,
                                tokens=np.frombuffer(job.tokens, dtype=np.int64),
                                rows=job.rows, parts=parts, nbytes=0)
            payload = link_payload(job, FP, parts, self.root, CLUSTER_KEY)
            parent = locator(CLUSTER_KEY, FP, domain, job.parent_digest) if job.start else b""
            peer.publish(locator(CLUSTER_KEY, FP, domain, job.digest), parent, job.start,
                         job.end, payload)
        r = self.cache.reserve("anchor", keys, ANCHOR_END, domain)
        assert r.link_id is not None
        fill_seeded(self.store, r.link_id, self.layout.view_rows(0, ANCHOR_END), gen)
        assert self.cache.commit(r.addr)
        ids.add(r.link_id)
        job = anchor_job(r.link_id, domain, self.cache.keys(prompt[:ANCHOR_END]),
                         self.layout.view_rows(0, ANCHOR_END), "now")
        parts = self.parts(r.link_id)
        assert writer.write(domain=domain, digest=job.digest, parent_digest=b"", start=0,
                            end=ANCHOR_END, tokens=np.frombuffer(job.tokens, dtype=np.int64),
                            rows=job.rows, parts=parts, nbytes=0, kind=ANCHOR)
        self.disk_anchors.note_spilled(domain, ANCHOR_END, job.digest)
        mine = self.remote_anchors.anchor_job(r.link_id, keys, domain, ANCHOR_END)
        block = block_locator(CLUSTER_KEY, FP, domain, keys.digest(anchor_block(ANCHOR_END)))
        self.transport.publish_anchor(locator(CLUSTER_KEY, FP, domain, mine.digest), block,
                                      ANCHOR_END,
                                      link_payload(mine, FP, parts, self.root, CLUSTER_KEY))
        writer.close()
        return ids

    def ask(self, domain: bytes, prompt: np.ndarray):
        """The facade's answer once no tier is pending (the scheduler asks once per step)."""
        keys = self.cache.keys(prompt)
        for _ in range(10):
            res = self.cache.lookup(keys, domain, len(prompt) - 1)
            if not res.pending:
                return keys, res
        raise AssertionError("still pending")


def _world(tmp_path: Path, name: str, layout) -> World:
    w = World(tmp_path / name, layout, FakeCluster())
    w.hold(A, PROMPT, seed=1)
    return w


def _per_tier(w: World, domain: bytes, prompt: np.ndarray) -> dict:
    """Every tier's own answer (pending answers polled away), as builtins."""
    keys = w.cache.keys(prompt)
    out = {}
    for route in w.cache.routes():
        t = w.cache.tier(*route)
        for _ in range(10):
            res = t.lookup(keys, domain, len(prompt) - 1)
            if not res.pending:
                break
        out[route] = msgspec.to_builtins(res)
    return out


def _stats(w: World) -> dict:
    return {route: msgspec.to_builtins(st) for route, st in w.cache.stats().items()}


def test_another_tenants_prefix_looks_like_no_prefix_in_every_tier(tmp_path, layout):
    """Tenant A holds PROMPT in every tier. Tenant B asking for PROMPT and tenant B asking for
    a prompt nobody holds get the same answers from every tier and the facade, and leave the
    same stats behind: nothing tells B that A has PROMPT."""
    probe, blank = _world(tmp_path, "probe", layout), _world(tmp_path, "blank", layout)
    assert _stats(probe) == _stats(blank)
    assert _per_tier(probe, B, PROMPT) == _per_tier(blank, B, UNKNOWN)
    assert {r["miss_reason"] for r in _per_tier(probe, B, PROMPT).values()} == {"no_prefix"}
    _, res_probe = probe.ask(B, PROMPT)
    _, res_blank = blank.ask(B, UNKNOWN)
    assert msgspec.to_builtins(res_probe) == msgspec.to_builtins(res_blank)
    assert (res_probe.hit, res_probe.miss_reason) == (False, MissReason.NO_PREFIX)
    for w, res in ((probe, res_probe), (blank, res_blank)):
        assert not w.cache.begin_restore(res)  # what the adapter does with a miss
    assert _stats(probe) == _stats(blank)
    assert probe.tree.stats().misses == {"no_prefix": 1}
    # what A itself is served: everything is really there (A's hit is as deep as its anchor)
    _, own = probe.ask(A, PROMPT)
    assert own.hit and own.tokens == ANCHOR_END


def test_the_comparison_sees_a_reason_that_stays(tmp_path, layout):
    """Negative control of the test above: the same comparison does tell apart a prompt that
    *the same tenant* holds under another domain (its other route: `domain_mismatch`, a
    reason that reveals nothing of another tenant) from an unknown one."""
    probe, blank = _world(tmp_path, "probe", layout), _world(tmp_path, "blank", layout)
    _, res_probe = probe.ask(A_MTP, PROMPT)
    _, res_blank = blank.ask(A_MTP, UNKNOWN)
    assert res_probe.miss_reason == MissReason.DOMAIN_MISMATCH != res_blank.miss_reason
    probe.cache.record_lookup(res_probe)
    blank.cache.record_lookup(res_blank)
    assert _stats(probe) != _stats(blank)


# ---------------------------------------------------------------- one tenant's clear
def _files(w: World) -> dict[bytes, list[str]]:
    """The link files on disk, by the tenant named in their headers."""
    from vllm_hybridcache.core.linkformat.linkfile import read_header

    out: dict[bytes, list[str]] = {}
    for p in sorted((w.root / "disk").rglob("*.link")):
        header, _ = read_header(p, FP, TEST_KEY)
        out.setdefault(tenant_of(header.domain), []).append(f"{header.kind}:{header.end}")
    return out


def test_clearing_a_tenant_leaves_the_others_in_every_tier(tmp_path, layout):
    w = World(tmp_path / "w", layout, FakeCluster())
    a_ids = w.hold(A, PROMPT, seed=1)
    w.hold(B, PROMPT, seed=2)  # the same prompt under tenant B, other bytes
    keys = w.cache.keys(PROMPT)
    _, before = w.ask(B, PROMPT)
    assert (before.tier, before.kind, before.tokens) == ("ram", "anchor", ANCHOR_END)
    expected_b = restored_bytes(w.store, before.plan.chain)
    tree_b = w.tree.lookup(keys, B, len(PROMPT) - 1)
    expected_tree_b = restored_bytes(w.store, tree_b.plan.chain)
    for dom in (A, B):  # both tenants' remote chains staged here (the peer's publications)
        assert _per_tier(w, dom, PROMPT)[("cluster", "tree")]["tokens"] == 256
    assert len(w.remote) == 6 and len(w.cluster.anchors) == 2
    # a tenant nobody uses: nothing goes (negative control of the counts below)
    assert w.cache.clear_tenant(tenant_tag("tenant-c")) == 0
    assert w.cache.drain_dropped() == [] and len(_files(w)[tenant_tag("tenant-a")]) == 4

    n = w.cache.clear_tenant(tenant_tag("tenant-a"))
    # RAM: 3 links and the anchor; disk: 3 tree files and the anchor file; cluster: 3 staged
    assert n == 3 + 1 + 3 + 1 + 3
    assert {a.link_id for a in w.cache.drain_dropped()} == a_ids
    assert w.remote_anchors.withdraw_tenant(tenant_tag("tenant-a")) == 1
    b_anchor = locator(CLUSTER_KEY, FP, B, keys.digest(ANCHOR_END))
    assert set(w.cluster.anchors) == {b_anchor}  # this replica's publication of A went
    files = _files(w)
    assert tenant_tag("tenant-a") not in files
    assert sorted(files[tenant_tag("tenant-b")]) == ["anchor:320", "tree:128", "tree:256",
                                                      "tree:64"]
    assert len(w.remote) == 3
    # A misses in every local tier now, as a tenant that never asked (the cluster tier finds
    # the peer's own publications again: they are the peer's links, not this replica's)
    local = {route: r for route, r in _per_tier(w, A, PROMPT).items() if route[0] != "cluster"}
    assert {r["miss_reason"] for r in local.values()} == {"no_prefix"}
    # B is served the same bytes as before, from RAM, and its files are there
    _, after = w.ask(B, PROMPT)
    assert (after.tier, after.kind, after.tokens) == ("ram", "anchor", ANCHOR_END)
    assert restored_bytes(w.store, after.plan.chain) == expected_b
    tree_after = w.tree.lookup(keys, B, len(PROMPT) - 1)
    assert restored_bytes(w.store, tree_after.plan.chain) == expected_tree_b
    assert w.disk.lookup(PROMPT, B, len(PROMPT) - 1).tokens == 256
    w.cache.sanity_check()


def test_a_tenants_clear_respects_restores_in_flight(tmp_path, layout):
    """A's chain is being restored when A is cleared: it leaves lookups at once, its payload
    is handed to the worker only when the restore ends (clear()'s guarantee)."""
    w = World(tmp_path / "w", layout, FakeCluster())
    w.hold(A, PROMPT, seed=1)
    keys = w.cache.keys(PROMPT)
    res = w.tree.lookup(keys, A, 300)
    assert res.hit and w.cache.begin_restore(res)
    assert w.cache.clear_tenant(tenant_tag("tenant-a"), tier="ram", kind="tree") == 3
    assert not w.tree.lookup(keys, A, 300).hit
    assert w.cache.drain_dropped() == []  # pinned: the worker still copies from them
    w.tree.sanity_check()
    w.cache.end_restore(res, True, 0.0)
    assert sorted(a.link_id for a in w.cache.drain_dropped()) == sorted(res.plan.link_ids)
    w.cache.sanity_check()


def test_a_tenants_clear_names_tiers_and_kinds_like_clear(tmp_path, layout):
    w = World(tmp_path / "w", layout, FakeCluster())
    w.hold(A, PROMPT, seed=1)
    tag = tenant_tag("tenant-a")
    with pytest.raises(ValueError, match="unknown tier"):
        w.cache.clear_tenant(tag, tier="tape")
    with pytest.raises(ValueError, match="tenant tag"):
        w.cache.clear_tenant(A)  # a whole domain is not a tag
    assert w.cache.clear_tenant(tag, tier="ram", kind="anchor") == 1
    assert len(w.tree) == 3 and len(w.anchors) == 0 and len(_files(w)[tag]) == 4
    assert w.cache.clear_tenant(tag, tier="disk") == 4
    assert len(w.tree) == 3 and not _files(w)
    assert w.disk.take_tenant_clears() == [(tag, TREE), (tag, ANCHOR)]
    assert w.disk.take_tenant_clears() == []


def test_the_cluster_tier_drops_what_it_staged_for_the_tenant(tmp_path, layout):
    """Another replica holds A's and B's links; this one staged both chains. Clearing A drops
    A's staged files (none left in the staging folder), B's stay and still serve."""
    cluster = FakeCluster()
    other = World(tmp_path / "other", layout, cluster)
    other.hold(A, PROMPT, seed=1)
    other.hold(B, PROMPT, seed=2)
    me = World(tmp_path / "me", layout, cluster)
    for dom in (A, B):
        res = _per_tier(me, dom, PROMPT)[("cluster", "tree")]
        assert (res["hit"], res["tokens"]) == (True, 256)
    assert len(me.remote) == 6
    assert me.remote.clear_tenant(tenant_tag("tenant-a")) == 3
    assert len(me.remote) == 3 and len(list((me.root / "stage").glob("*.link"))) == 3
    keys = me.cache.keys(PROMPT)
    res_b = me.remote.lookup(keys, B, len(PROMPT) - 1)
    assert (res_b.hit, res_b.tokens) == (True, 256)
    # A is located again from scratch (pending), not served from the dropped files
    assert me.remote.lookup(keys, A, len(PROMPT) - 1).pending
    me.remote.sanity_check()


def test_the_writer_deletes_a_cleared_tenants_writes_that_land_later(tmp_path, layout):
    """A's and B's writes are queued when A is cleared: the writer's clear follows them in its
    queue, so A's file is deleted after it lands and B's stays; the writer's index counts B's
    file only."""
    w = World(tmp_path / "w", layout, FakeCluster())
    keys = w.cache.keys(PROMPT)
    jobs = []
    for dom, seed in ((A, 1), (B, 2)):
        r = w.cache.reserve("tree", keys, 64, dom)
        fill_seeded(w.store, r.link_id, layout.view_rows(0, 64), torch.Generator().manual_seed(
            seed))
        assert w.cache.commit(r.addr)
        jobs.append(w.disk.write_job(w.tree.link_record(r.link_id)))
    writer = LinkWriter(DiskTarget(str(w.root / "disk"), FP, 1 << 30, 0, 0.0,
                                   key_file=str(KEY_FILE)))
    for job in jobs:
        assert writer.submit(job, w.parts(job.link_id))
    writer.clear_tenant(tenant_tag("tenant-a"), TREE)
    assert writer.close(30)
    assert list(_files(w)) == [tenant_tag("tenant-b")]
    assert writer.snapshot()["files"] == 1


def test_the_writer_without_the_clear_keeps_the_file(tmp_path, layout):
    """Negative control of the test above: the same queue without the tenant's clear leaves
    A's file on disk."""
    w = World(tmp_path / "w", layout, FakeCluster())
    keys = w.cache.keys(PROMPT)
    r = w.cache.reserve("tree", keys, 64, A)
    fill_seeded(w.store, r.link_id, layout.view_rows(0, 64), torch.Generator().manual_seed(1))
    assert w.cache.commit(r.addr)
    job = w.disk.write_job(w.tree.link_record(r.link_id))
    writer = LinkWriter(DiskTarget(str(w.root / "disk"), FP, 1 << 30, 0, 0.0,
                                   key_file=str(KEY_FILE)))
    assert writer.submit(job, w.parts(job.link_id))
    assert writer.close(30)
    assert list(_files(w)) == [tenant_tag("tenant-a")]


def test_a_tenants_clear_finds_files_another_instance_wrote(tmp_path, layout):
    """The scheduler's directory was indexed before the writer wrote A's and B's files: the
    tenant's clear finds A's by their folders' names (no header read), deletes A's only, and
    an index that lists a file another process deleted forgets it."""
    from vllm_hybridcache.core.disk import directory as directory_mod

    w = World(tmp_path / "w", layout, FakeCluster())
    assert len(w.dir) == 0
    w.hold(A, PROMPT, seed=1)
    w.hold(B, PROMPT, seed=2)
    assert len(w.dir) == 0  # not indexed here: written by another instance
    reads: list = []
    real = directory_mod.read_header
    directory_mod.read_header = lambda *a, **k: reads.append(a) or real(*a, **k)
    try:
        assert w.dir.clear_tenant(tenant_tag("tenant-a"), TREE) == 3
        assert reads == []  # found by name
        w.dir.lookup(PromptKeys(PROMPT), B, [64], 400)
        assert reads  # control: the patch sees the directory's header reads
    finally:
        directory_mod.read_header = real
    assert sorted(_files(w)[tenant_tag("tenant-a")]) == ["anchor:320"]  # anchors: own kind
    assert w.dir.clear_tenant(tenant_tag("tenant-a"), ANCHOR) == 1
    again = LinkDirectory(w.root / "disk", FP, 1 << 30, key=TEST_KEY)
    again.open()
    assert len(again) == 4  # B's files
    w.dir.clear_tenant(tenant_tag("tenant-b"), TREE)
    assert len(again) == 4 and again.clear_tenant(tenant_tag("tenant-b"), TREE) == 0
    assert len(again) == 1  # the three deleted by the other instance are forgotten
    again.sanity_check()


def test_spill_book_forgets_a_cleared_tenants_anchors():
    book = SpillBook()
    toks = np.arange(100, dtype=np.int64)
    for lid, dom in ((1, A), (2, B), (3, A_MTP)):
        book.reserved(anchor_job(lid, dom, PromptKeys(toks[: 10 * lid]), 1, "spill"),
                      toks[: 10 * lid])
        book.committed(lid)
    book.discard_domains(in_tenant(tenant_tag("tenant-a")))
    assert [j.link_id for j in book.dropped([1, 2, 3])] == [2]
