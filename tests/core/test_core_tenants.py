"""Tenants (issue 29): a domain names its tenant (the tag of the request's `cache_salt`), and
no tier tells a tenant whether another tenant holds a prefix.

Every tier of an engine is here without vLLM: RAM tree and end anchors, disk tree and spilled
anchors (files written by a second directory instance, as the writer thread does), and the
cluster tier and its anchors over the fake transport (a peer replica publishes).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import torch

from tests.cluster.fakes import Clock, FakeCluster, FakeTransport
from tests.core.link_bytes import fill_seeded
from vllm_hybridcache.core import (
    EndAnchors,
    IdSource,
    LinkStore,
    MissReason,
    SnapshotCache,
    SnapshotTree,
    TreeConfig,
    make_domain,
)
from vllm_hybridcache.core.disk import LinkDirectory
from vllm_hybridcache.core.disk.directory import ANCHOR
from vllm_hybridcache.core.disk.spill import anchor_job
from vllm_hybridcache.core.disk.writer import WriteJob
from vllm_hybridcache.core.tiers.cluster import (
    ClusterAnchors,
    ClusterTier,
    anchor_block,
    link_payload,
)
from vllm_hybridcache.core.tiers.disk import DiskAnchors, DiskTier

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
        self.dir = LinkDirectory(root / "disk", FP, 1 << 30)
        self.dir.open()
        self.disk = DiskTier(layout, self.dir, cuts_of, next_id=ids, promote=self.tree.adopt)
        self.disk_anchors = DiskAnchors(self.disk)
        self.transport = FakeTransport(cluster, "me")
        self.remote = ClusterTier(layout, FP, self.transport, cuts_of, root / "stage", 1 << 30,
                                  10.0, next_id=ids, promote=self.tree.adopt, clock=self.clock,
                                  owner="me")
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
        writer = LinkDirectory(self.root / "disk", FP, 1 << 30)
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
            payload = link_payload(job, FP, parts, self.root)
            peer.publish(FP, domain, job.digest, job.parent_digest, job.start, job.end,
                         payload)
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
        block = keys.digest(anchor_block(ANCHOR_END))
        self.transport.publish_anchor(FP, domain, mine.digest, block, ANCHOR_END,
                                      link_payload(mine, FP, parts, self.root))
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
