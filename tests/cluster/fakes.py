"""The cluster tests' in-process stand-ins for Ray: a fake directory and object store shared by
replicas without vLLM (RAM tree, cluster tier, optionally RAM and cluster end anchors, a worker
store), and the helpers that commit, publish, look up and restore on them."""

from __future__ import annotations

import numpy as np
import torch

from tests.core.link_bytes import fill_seeded, restored_bytes
from tests.keys import CLUSTER_KEY
from vllm_hybridcache.core import IdSource, LinkStore, SnapshotCache, SnapshotTree, TreeConfig
from vllm_hybridcache.core.keys import PromptKeys, make_domain
from vllm_hybridcache.core.linkformat.reader import SourceOrigin, stage_chain
from vllm_hybridcache.core.linkformat.shard import Shard
from vllm_hybridcache.core.tiers.anchors import EndAnchors
from vllm_hybridcache.core.tiers.cluster import (
    ClusterError,
    ClusterMiss,
    ClusterTier,
    RemoteEntry,
    anchor_block,
    block_locator,
    link_payload,
    locator,
)
from vllm_hybridcache.core.tiers.cluster_anchors import ClusterAnchors

FP = b"F" * 32
DOM = make_domain(model="m")
PROMPT = np.arange(5000, 5400, dtype=np.int64)
CUTS = [64, 128, 256]


def cuts_of(tokens: np.ndarray) -> list[int]:
    return [c for c in CUTS if c <= len(tokens)]


def relisted(e: RemoteEntry, keys: PromptKeys, fp: bytes = FP, dom: bytes = DOM,
             key=CLUSTER_KEY) -> tuple[bytes, RemoteEntry]:
    """Entry `e` listed where the link of `keys` over [e.start, e.end) of (fp, dom) would be
    (its locator and its parent's recomputed): what a confused or hostile directory answers."""
    loc = locator(key, fp, dom, keys.digest(e.end))
    parent = locator(key, fp, dom, keys.digest(e.start)) if e.start else b""
    return loc, e._replace(locator=loc, parent_locator=parent)


class Answer:
    """A Pending that is done after `polls` calls of done()."""

    def __init__(self, value=None, error: ClusterError | None = None, polls: int = 1) -> None:
        self.value, self.error, self.polls = value, error, polls

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def result(self):
        assert self.polls < 0, "result() before done()"
        if self.error is not None:
            raise self.error
        return self.value


class FakeCluster:
    """The directory and the object store of a cluster, in process (keyed by locators, as the
    directory actor is)."""

    def __init__(self) -> None:
        self.entries: dict[bytes, RemoteEntry] = {}
        # end anchors: locator -> (block locator, entry), as the directory actor keeps them
        self.anchors: dict[bytes, tuple[bytes, RemoteEntry]] = {}
        self.objects: dict[int, bytes] = {}
        self.dead: set[str] = set()
        self.forgotten: list[bytes] = []
        self.delay = 1
        self.silent = False  # never answer (timeouts)


class FakeTransport:
    def __init__(self, cluster: FakeCluster, owner: str) -> None:
        self.c, self.owner = cluster, owner

    def locate(self, locators):
        found = [self.c.entries[loc] for loc in locators if loc in self.c.entries]
        return Answer(found, polls=10**9 if self.c.silent else self.c.delay)

    def fetch(self, entries):
        dead = [e.owner for e in entries if e.owner in self.c.dead]
        if dead:
            return Answer(error=ClusterError(ClusterMiss.OWNER_LOST, dead[0]), polls=self.c.delay)
        missing = [e for e in entries if e.handle not in self.c.objects]
        if missing:
            return Answer(error=ClusterError(ClusterMiss.OBJECT_LOST, "gone"), polls=self.c.delay)
        return Answer([self.c.objects[e.handle] for e in entries], polls=self.c.delay)

    def forget(self, locators):
        for loc in locators:
            self.c.forgotten.append(loc)
            self.c.entries.pop(loc, None)

    def publish(self, loc, parent, start, end, payload):
        h = len(self.c.objects) + 1
        self.c.objects[h] = payload
        self.c.entries[loc] = RemoteEntry(loc, parent, start, end, len(payload), self.owner, h)

    def locate_anchors(self, blocks, limit):
        found = [e for b, e in self.c.anchors.values() if b in set(blocks) and e.end <= limit]
        return Answer(found, polls=10**9 if self.c.silent else self.c.delay)

    def forget_anchors(self, locators, owner=None):
        for loc in locators:
            if loc in self.c.anchors and owner in (None, self.c.anchors[loc][1].owner):
                self.c.forgotten.append(loc)
                del self.c.anchors[loc]

    def publish_anchor(self, loc, block, end, payload):
        h = len(self.c.objects) + 1
        self.c.objects[h] = payload
        self.c.anchors[loc] = (block, RemoteEntry(loc, b"", 0, end, len(payload), self.owner, h))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Replica:
    """One replica without vLLM: RAM tree + cluster tier (scheduler), store (worker); with
    `anchors`, also RAM end anchors and the cluster's end anchors (ClusterAnchors). With
    `shards` = N > 1 it stands for an engine at tensor parallel size N: one store per rank
    (`stores`; `store` is rank 0's), each rank's shard of a link its own seeded bytes,
    published under the rank's locator (as each rank's worker does, cluster/engine.py)."""

    def __init__(self, cluster: FakeCluster, name: str, layout, tmp_path, fp: bytes = FP,
                 budget: int = 1 << 30, anchors: bool = False, key=CLUSTER_KEY,
                 shards: int = 1) -> None:
        ids = IdSource()
        self.key = key
        self.clock = Clock()
        self.tree = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 30, memory_floor_bytes=0),
                                 next_id=ids)
        self.transport = FakeTransport(cluster, name)
        self.tier = ClusterTier(layout, fp, self.transport, cuts_of, tmp_path / name / "stage",
                                budget, timeout_s=10.0, next_id=ids, promote=self.tree.adopt,
                                clock=self.clock, owner=name,
                                baseline=lambda k, d, lim: self.tree.lookup(k, d, lim).tokens,
                                key=key, shards=shards)
        tiers = [self.tree, self.tier]
        self.anchors: EndAnchors | None = None
        self.remote_anchors: ClusterAnchors | None = None
        if anchors:
            self.anchors = EndAnchors(layout, 8, 1 << 30, next_id=ids)
            ram = self.anchors
            self.remote_anchors = ClusterAnchors(
                self.tier, local=lambda k, d, lim: ram.lookup(k, d, lim).tokens)
            tiers += [self.anchors, self.remote_anchors]
        self.cache = SnapshotCache(tiers)
        self.stores = [LinkStore(layout, pin_memory=False) for _ in range(shards)]
        self.store = self.stores[0]
        self.shards = shards
        self.layout, self.fp, self.tmp = layout, fp, tmp_path / name
        self.tmp.mkdir(parents=True, exist_ok=True)

    def capture(self, prompt: np.ndarray, seed: int = 0) -> None:
        """Commit a link at every cut (seeded bytes) and publish it, as the adapter does."""
        keys = self.tree.keys(prompt)
        gen = torch.Generator().manual_seed(seed)
        for c in cuts_of(keys.tokens):
            r = self.cache.reserve("tree", keys, c, DOM)
            assert r.link_id is not None
            for store in self.stores:
                fill_seeded(store, r.link_id, self.layout.view_rows(r.start, r.end), gen)
            assert self.cache.commit(r.addr)
            job = self.tier.publish_job(self.tree.link_record(r.link_id))
            assert job is not None
            for rank in range(self.shards):
                self.publish(job, rank)

    def publish(self, job, rank: int = 0) -> None:
        """Rank `rank`'s worker's publication of `job` (its shard of the link)."""
        tag = Shard(rank, self.shards).tag
        b = self.stores[rank].buffers(job.link_id)
        payload = link_payload(job, self.fp, {**b.sections, **b.views}, self.tmp, self.key,
                               shard=tag)
        parent = (locator(self.key, self.fp, job.domain, job.parent_digest, tag) if job.start
                  else b"")
        self.transport.publish(locator(self.key, self.fp, job.domain, job.digest, tag),
                               parent, job.start, job.end, payload)

    def capture_anchor(self, tokens: np.ndarray, seed: int = 0, publish: bool = True) -> int:
        """Commit an end anchor of `tokens` (seeded bytes) and publish it, as the adapter and
        the worker do at a finished request's capture; its link id."""
        keys = self.cache.keys(tokens)
        r = self.cache.reserve("anchor", keys, len(tokens), DOM)
        assert r.link_id is not None
        fill_seeded(self.store, r.link_id, self.layout.view_rows(0, len(tokens)),
                    torch.Generator().manual_seed(seed))
        assert self.cache.commit(r.addr)
        job = self.remote_anchors.anchor_job(r.link_id, keys, DOM, len(tokens))
        if publish:
            assert job is not None and job.kind == "anchor"
            b = self.store.buffers(job.link_id)
            payload = link_payload(job, self.fp, {**b.sections, **b.views}, self.tmp, self.key)
            block = block_locator(self.key, self.fp, job.domain,
                                  keys.digest(anchor_block(len(tokens))))
            self.transport.publish_anchor(locator(self.key, self.fp, job.domain, job.digest),
                                          block, job.end, payload)
        return r.link_id

    def lookup(self, prompt: np.ndarray, polls: int = 10):
        """Ask until the answer is not pending (the scheduler asks once per step)."""
        keys = self.cache.keys(prompt)
        for _ in range(polls):
            res = self.cache.lookup(keys, DOM, len(prompt) - 1)
            if not res.pending:
                return keys, res
        return keys, res

    def restore_bytes(self, chain) -> dict[str, bytes]:
        return restored_bytes(self.store, chain)

    def serve_ranks(self, res) -> list[dict[str, bytes]]:
        """`serve` at tensor parallel size N: each rank's worker stages its own rank's files
        (the plan's sources relocated to its shard folder, headers of its shard tag) into its
        store; each rank's restored bytes."""
        assert self.cache.begin_restore(res)
        origin = SourceOrigin(self.fp, "", "cluster", str(self.tier.stage_dir),
                              shards=self.shards)
        out = []
        try:
            for rank, store in enumerate(self.stores):
                sources, tag = origin.for_rank(rank, self.cache.sources(res))
                stage_chain(store, res.plan.chain, sources, self.fp, key=self.key,
                            root=self.tier.stage_dir, shard=tag)
                out.append(restored_bytes(store, res.plan.chain))
        except Exception:
            self.cache.end_restore(res, False, 0.01)
            raise
        self.cache.end_restore(res, True, 0.01)
        return out

    def serve(self, res) -> dict[str, bytes]:
        """The worker's part of a remote hit: stage the files verified, then restore."""
        assert self.cache.begin_restore(res)
        stage_chain(self.store, res.plan.chain, self.cache.sources(res), self.fp, key=self.key,
                    root=self.tier.stage_dir)
        out = self.restore_bytes(res.plan.chain)
        self.cache.end_restore(res, True, 0.01)
        return out
