"""Session spill without vLLM: end anchors written by the writer's shutdown drain (or when RAM
evicts them), read back by the next life's disk anchor tier byte for byte; which anchors are
written (SpillBook); the drain's time limit; anchors never served as tree links."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.core.link_bytes import fill_seeded, restored_bytes
from tests.keys import KEY_FILE, TEST_KEY
from vllm_hybridcache.core import (
    EndAnchors,
    IdSource,
    LinkStore,
    PromptKeys,
    SnapshotCache,
    SnapshotTree,
    TreeConfig,
)
from vllm_hybridcache.core.disk import LinkDirectory
from vllm_hybridcache.core.disk.spill import SpillBook, anchor_job
from vllm_hybridcache.core.disk.writer import DiskTarget, LinkWriter
from vllm_hybridcache.core.keys import make_domain
from vllm_hybridcache.core.linkformat.job import ANCHOR, WriteJob
from vllm_hybridcache.core.linkformat.reader import DiskReadError, stage_chain
from vllm_hybridcache.core.linkformat.tags import TagCodec
from vllm_hybridcache.core.tiers.base import LinkAddr
from vllm_hybridcache.core.tiers.disk import DiskTier
from vllm_hybridcache.core.tiers.disk_anchors import DiskAnchors

FP = b"S" * 32
DOM = make_domain(model="m", salt="a")
OTHER = make_domain(model="m", salt="b")
CUTS = [64, 128, 256]
TURN = np.arange(9000, 9300, dtype=np.int64)  # a finished request: prompt + answer, n = 300


def _cuts(tokens: np.ndarray) -> list[int]:
    return [c for c in CUTS if c <= len(tokens)]


class Life:
    """One engine life: RAM tree + RAM anchors + disk tiers + the worker's store and writer."""

    def __init__(self, root: Path, layout, tags: TagCodec | None = None) -> None:
        """tags: the anchor tag codec (a speculative route); None on the AR route."""
        ids = IdSource()
        self.layout = layout
        self.tree = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 30, memory_floor_bytes=0),
                                 next_id=ids)
        self.directory = LinkDirectory(root, FP, 1 << 30, key=TEST_KEY)
        self.directory.open()
        self.disk = DiskTier(layout, self.directory, _cuts, next_id=ids, promote=self.tree.adopt)
        self.ram_anchors = EndAnchors(layout, 8, 1 << 30, next_id=ids)
        self.disk_anchors = DiskAnchors(self.disk, tags=tags)
        self.cache = SnapshotCache([self.tree, self.disk, self.ram_anchors, self.disk_anchors])
        self.store = LinkStore(layout, pin_memory=False)
        self.target = DiskTarget(str(root), FP, 1 << 30, 0, 0.0, spill=True, drain_s=30.0,
                                 key_file=str(KEY_FILE))

    def anchor(self, tokens: np.ndarray, domain: bytes = DOM, seed: int = 0, tag=None):
        """Reserve (with its draft tag, if any), fill with seeded bytes and commit an end
        anchor; its spill job (None when no file can carry the tag)."""
        r = self.cache.reserve("anchor", tokens, len(tokens), domain, tag)
        fill_seeded(self.store, r.link_id, self.layout.view_rows(0, len(tokens)),
                    torch.Generator().manual_seed(seed))
        assert self.cache.commit(r.addr)
        return self.disk_anchors.spill_job(r.link_id, domain, PromptKeys(tokens),
                                           self.layout.view_rows(0, len(tokens)), tag)

    def parts(self, link_id: int) -> dict[str, torch.Tensor]:
        b = self.store.buffers(link_id)
        return {**b.sections, **b.views}

    def restore_bytes(self, chain) -> dict[str, bytes]:
        return restored_bytes(self.store, chain)


@pytest.fixture
def spilled(tmp_path, layout):
    """Life 1 ends with a shutdown drain of one end anchor; its restore bytes."""
    life = Life(tmp_path, layout)
    job = life.anchor(TURN)
    expected = life.restore_bytes(life.ram_anchors.lookup(TURN, DOM).plan.chain)
    report = LinkWriter(life.target).drain([(job, life.parts(job.link_id))], 30.0)
    assert (report.anchors, report.anchors_written, report.skipped) == (1, 1, 0)
    assert report.finished and report.anchor_bytes > 0
    life.directory.close()
    files = list(tmp_path.rglob("*.link"))
    assert len(files) == 1 and files[0].parent.name.startswith("a-")
    return tmp_path, expected


def test_a_spilled_anchor_resumes_the_next_life_byte_for_byte(spilled, layout):
    root, expected = spilled
    life = Life(root, layout)
    nxt = np.concatenate([TURN, [1, 2, 3]])  # the next turn extends prompt + answer
    res = life.cache.lookup(nxt, DOM, len(nxt) - 1)
    assert (res.hit, res.tier, res.kind, res.tokens) == (True, "disk", "anchor", len(TURN))
    assert not life.cache.cold_exact(res)  # session-exact: the request publishes nothing shared
    assert life.cache.begin_restore(res)
    stage_chain(life.store, res.plan.chain, life.cache.sources(res), FP, key=TEST_KEY)
    assert life.restore_bytes(res.plan.chain) == expected
    life.cache.end_restore(res, True, 0.01)
    assert [a.link_id for a in life.cache.drain_dropped()] == list(res.plan.link_ids)
    st = life.cache.stats()[("disk", "anchor")]
    assert (st.hits, st.restores, st.tokens_served, st.links) == (1, 1, len(TURN), 1)
    life.cache.sanity_check()


def test_negative_control_a_flipped_byte_fails_the_read(spilled, layout):
    root, _ = spilled
    f = next(root.rglob("*.link"))
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x01
    f.write_bytes(bytes(raw))
    life = Life(root, layout)
    nxt = np.concatenate([TURN, [1]])
    res = life.cache.lookup(nxt, DOM, len(nxt) - 1)
    assert res.tier == "disk" and life.cache.begin_restore(res)
    with pytest.raises(DiskReadError) as err:
        stage_chain(life.store, res.plan.chain, life.cache.sources(res), FP, key=TEST_KEY)
    assert err.value.problem == "checksum"
    life.cache.end_restore(res, False)
    life.cache.invalidate([LinkAddr("disk", "anchor", res.plan.deepest)])
    assert not f.exists()  # deleted: never offered again
    assert not life.cache.lookup(nxt, DOM, len(nxt) - 1).hit


def test_anchors_serve_only_their_domain_and_their_own_tokens(spilled, layout):
    root, _ = spilled
    life = Life(root, layout)
    nxt = np.concatenate([TURN, [1, 2]])
    assert not life.cache.lookup(nxt, OTHER, len(nxt) - 1).hit  # another cache_salt
    changed = nxt.copy()
    changed[150] += 1  # one token differs: not this conversation
    assert not life.cache.lookup(changed, DOM, len(changed) - 1).hit
    assert not life.cache.lookup(TURN, DOM, len(TURN) - 1).hit  # must strictly extend it


def test_an_anchor_is_never_a_tree_link(tmp_path, layout):
    """An anchor spilled at a cut position lies in its own folder and header kind: the tree
    tier's lookup of the same prompt does not find it."""
    life = Life(tmp_path, layout)
    job = life.anchor(TURN[:256])  # ends at a cut
    LinkWriter(life.target).drain([(job, life.parts(job.link_id))], 30.0)
    again = Life(tmp_path, layout)
    assert not again.disk.lookup(TURN, DOM).hit
    assert again.directory.path_for(DOM, 256, job.digest).exists() is False
    assert again.directory.path_for(DOM, 256, job.digest, ANCHOR).exists()
    res = again.cache.lookup(TURN, DOM)
    assert (res.tier, res.kind, res.tokens) == ("disk", "anchor", 256)


def test_the_drain_time_limit_drops_what_is_left(tmp_path, layout):
    life = Life(tmp_path, layout)
    jobs = [life.anchor(TURN[: 100 + i], domain=make_domain(model="m", salt=str(i)))
            for i in range(3)]
    report = LinkWriter(life.target).drain([(j, life.parts(j.link_id)) for j in jobs], 0.0)
    assert (report.anchors, report.anchors_written, report.skipped) == (3, 0, 3)
    assert not list(tmp_path.rglob("*.link"))


def test_spill_book_writes_evictions_only():
    """Only committed anchors RAM dropped for room are written: not ones a newer anchor of the
    same conversation supersedes, not failed or cleared ones, not uncommitted ones."""
    book = SpillBook()
    a = np.arange(100, dtype=np.int64)

    def job(lid, toks, dom=DOM):
        return anchor_job(lid, dom, PromptKeys(toks), 1, "spill")

    book.reserved(job(1, a[:50]), a[:50])
    book.reserved(job(2, a[:10], OTHER), a[:10])
    book.reserved(job(3, a[:80]), a[:80])  # the conversation of 1 moved on: 1 is superseded
    assert 1 not in book and 3 in book and 2 in book
    book.committed(2)
    book.committed(3)
    book.reserved(job(4, a[:20]), a[:20])  # reserved, never committed
    out = book.dropped([1, 2, 4])
    assert [(j.link_id, j.when, j.kind, j.end) for j in out] == [(2, "now", "anchor", 10)]
    book.discard([3])
    assert book.dropped([3]) == []
    tagged = anchor_job(6, OTHER, PromptKeys(a[:60] + 1), 1, "spill", ("Rebuilt", ()))
    book.reserved(tagged, a[:60] + 1)
    book.committed(6)
    assert [(j.link_id, j.when, j.tag) for j in book.dropped([6])] == [
        (6, "now", ("Rebuilt", ()))]  # an evicted anchor's write keeps its draft tag
    book.reserved(job(5, a[:30], OTHER), a[:30])
    book.committed(5)
    book.superseded(OTHER, a[:40])  # a newer anchor of 5's conversation, not written (its tag)
    assert 5 not in book and book.dropped([5]) == []
    book.reserved(job(5, a[:30], OTHER), a[:30])
    book.committed(5)
    book.discard_all()
    assert book.dropped([5]) == [] and len(book) == 0


def test_an_evicted_anchor_is_written_and_served_in_the_same_life(tmp_path, layout):
    """RAM evicts a committed anchor (count bound); the book makes its write, the writer
    writes it before the store drops it, and the disk anchor tier serves the conversation's
    next turn."""
    life = Life(tmp_path, layout)
    life.ram_anchors.max_count = 1
    book = SpillBook()
    first = life.anchor(TURN)
    book.reserved(first, TURN)
    book.committed(first.link_id)
    second = life.anchor(TURN[:100] + 1, domain=OTHER)  # evicts the first (LRU, count 1)
    dropped = [a.link_id for a in life.cache.drain_dropped()]
    assert dropped == [first.link_id]
    (job,) = book.dropped(dropped)
    w = LinkWriter(life.target)
    assert w.submit(job, life.parts(job.link_id))
    assert w.close(30)
    life.disk_anchors.note_spilled(job.domain, job.end, job.digest)
    nxt = np.concatenate([TURN, [5]])
    res = life.cache.lookup(nxt, DOM, len(nxt) - 1)
    assert (res.tier, res.kind, res.tokens) == ("disk", "anchor", len(TURN))
    assert second.link_id in life.ram_anchors.link_ids()


def test_clearing_anchors_tells_the_writers_index_and_keeps_tree_links(tmp_path, layout):
    life = Life(tmp_path, layout)
    job = life.anchor(TURN)
    # a tree link [0, 64) of the same prompt, written from the anchor's first rows
    tree_job = WriteJob(job.link_id, DOM, PromptKeys(TURN).digest(64), b"", 0, 64,
                        TURN[:64].tobytes(), layout.view_rows(0, 64))
    w = LinkWriter(life.target)
    parts = {k: (v if k in {s.name for s in layout.sections} else v[: tree_job.rows])
             for k, v in life.parts(job.link_id).items()}
    assert w.submit(tree_job, parts)
    w.drain([(job, life.parts(job.link_id))], 30.0)
    again = Life(tmp_path, layout)
    assert len(again.disk_anchors) == 1 and again.disk.lookup(TURN, DOM).tokens == 64
    assert again.cache.clear("disk", "anchor") == 1
    assert not list(tmp_path.rglob("a-*/*.link")) and len(again.disk_anchors) == 0
    forget, clear_all = again.disk.take_writer_ops()
    assert [Path(p) for p in forget] == [again.directory.path_for(DOM, job.end, job.digest,
                                                                   "anchor")]
    assert not clear_all and again.disk.lookup(TURN, DOM).tokens == 64  # tree link kept
