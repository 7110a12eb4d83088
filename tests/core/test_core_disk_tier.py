"""The disk tier end to end without vLLM: RAM links written by the writer thread, a "restart"
(new tree, store, directory and tier on the same folder), the chain found on disk, staged into
a fresh store and restored byte for byte; faults are counted misses that lose nothing else."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.core.link_bytes import fill_seeded, restored_bytes
from tests.keys import KEY_FILE, TEST_KEY
from vllm_hybridcache.core import (
    DiskTier,
    IdSource,
    LinkStore,
    PromptKeys,
    SnapshotCache,
    SnapshotTree,
    TreeConfig,
)
from vllm_hybridcache.core.disk import LinkDirectory
from vllm_hybridcache.core.disk.writer import DiskTarget, LinkWriter
from vllm_hybridcache.core.keys import make_domain
from vllm_hybridcache.core.linkformat.job import WriteJob
from vllm_hybridcache.core.linkformat.reader import DiskReadError, stage_chain
from vllm_hybridcache.core.tiers.base import LinkAddr

FP = b"F" * 32
DOM = make_domain(model="m")
PROMPT = np.arange(5000, 5400, dtype=np.int64)
CUTS = [64, 128, 256]


def _cuts(tokens: np.ndarray) -> list[int]:
    return [c for c in CUTS if c <= len(tokens)]


class Engine:
    """One 'engine life' on a folder: RAM tree + store (worker) + disk tier + writer."""

    def __init__(self, root: Path, layout, fp: bytes = FP, budget: int = 1 << 30) -> None:
        ids = IdSource()
        self.tree = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 30, memory_floor_bytes=0),
                                 next_id=ids)
        self.directory = LinkDirectory(root, fp, budget, key=TEST_KEY)
        self.directory.open()
        self.disk = DiskTier(layout, self.directory, _cuts, next_id=ids, promote=self.tree.adopt)
        self.cache = SnapshotCache([self.tree, self.disk])
        self.store = LinkStore(layout, pin_memory=False)
        self.target = DiskTarget(str(root), fp, budget, 0, 0.0, key_file=str(KEY_FILE))
        self._writer: LinkWriter | None = None
        self.layout = layout

    @property
    def writer(self) -> LinkWriter:
        """Started on first use, as in the worker (its start-up scan would race the tests'
        file edits otherwise)."""
        if self._writer is None:
            self._writer = LinkWriter(self.target)
        return self._writer

    def capture(self, prompt: np.ndarray, seed: int = 0) -> dict[int, int]:
        """Reserve, fill with seeded bytes, seal and commit a link at every cut; queue each
        write like the adapter does. Returns cut -> RAM link id."""
        keys = self.tree.keys(prompt)
        out = {}
        gen = torch.Generator().manual_seed(seed)
        for c in _cuts(keys.tokens):
            r = self.cache.reserve("tree", keys, c, DOM)
            if r.link_id is None:
                out[c] = r.existing_id
                continue
            fill_seeded(self.store, r.link_id, self.layout.view_rows(r.start, r.end), gen)
            assert self.cache.commit(r.addr)
            job = self.disk.write_job(self.tree.link_record(r.link_id))
            if job is not None:  # None: the file exists already
                b = self.store.buffers(job.link_id)
                assert self.writer.submit(job, {**b.sections, **b.views})
            out[c] = r.link_id
        return out

    def flush(self) -> None:
        assert self.writer.close(30)
        self.disk.absorb_worker(self.writer.snapshot())

    def restore_bytes(self, chain, store: LinkStore | None = None) -> dict[str, bytes]:
        """Every section of the deepest link and every view's rows, as bytes."""
        return restored_bytes(store or self.store, chain)


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.link"))


@pytest.fixture
def written(tmp_path, layout):
    """A first engine life that captured PROMPT and wrote it; its expected restore bytes."""
    e = Engine(tmp_path, layout)
    ids = e.capture(PROMPT)
    e.flush()
    assert len(_files(tmp_path)) == 3
    expected = e.restore_bytes(e.tree.lookup(e.tree.keys(PROMPT), DOM).plan)
    e.directory.close()
    return tmp_path, ids, expected


def _restart(root, layout, **kw) -> Engine:
    return Engine(root, layout, **kw)


def test_restart_round_trip_restores_the_same_bytes(written, layout):
    root, _, expected = written
    e = _restart(root, layout)
    keys = e.cache.keys(np.concatenate([PROMPT, [7, 8, 9]]))
    res = e.cache.lookup(keys, DOM, len(keys) - 1)
    assert (res.hit, res.tier, res.kind, res.tokens) == (True, "disk", "tree", 256)
    assert [(r.start, r.end) for r in res.plan.chain] == [(0, 64), (64, 128), (128, 256)]
    assert e.cache.begin_restore(res)
    sources = e.cache.sources(res)
    assert len(sources) == 3
    stage_chain(e.store, res.plan.chain, sources, FP, key=TEST_KEY)
    assert e.restore_bytes(res.plan.chain) == expected
    e.cache.end_restore(res, True, 0.01)
    # promoted: the RAM tree adopted the staged links, nothing is dropped, and the next lookup
    # is served from RAM with the same bytes
    assert e.cache.drain_dropped() == []
    st = e.cache.stats()[("disk", "tree")]
    assert (st.hits, st.restores, st.tokens_served, st.links) == (1, 1, 256, 3)
    assert e.tree.stats().promoted == 3
    again = e.cache.lookup(keys, DOM, len(keys) - 1)
    assert (again.tier, again.tokens, again.plan.link_ids) == ("ram", 256, res.plan.link_ids)
    assert e.restore_bytes(again.plan) == expected
    e.cache.sanity_check()


def test_promotion_adopts_only_where_the_tree_would_put_a_link(written, layout):
    """RAM already holds [0, 128) as one link: the disk's [0, 64) is adopted as a root link,
    its [64, 128) is not (the tree has that cut), its [128, 256) goes under the tree's link."""
    root, _, _ = written
    e = _restart(root, layout)
    keys = e.cache.keys(PROMPT)
    r = e.tree.reserve(keys, 128, DOM)
    e.store.allocate(r.link_id, layout.view_rows(0, 128))
    e.store.seal(r.link_id)
    e.tree.commit(r.link_id)
    res = e.cache.lookup(keys, DOM)
    assert (res.tier, res.tokens) == ("disk", 256)
    assert e.cache.begin_restore(res)
    stage_chain(e.store, res.plan.chain, e.cache.sources(res), FP, key=TEST_KEY)
    e.cache.end_restore(res, True)
    ids = res.plan.link_ids
    assert [a.link_id for a in e.cache.drain_dropped()] == [ids[1]]
    e.store.drop([ids[1]])
    assert e.tree.parent_of(ids[2]) == r.link_id and e.tree.parent_of(ids[0]) is None
    again = e.cache.lookup(keys, DOM)
    assert (again.tier, again.plan.link_ids) == ("ram", (r.link_id, ids[2]))
    e.cache.sanity_check()


def test_a_failed_restore_promotes_nothing(written, layout):
    root, _, _ = written
    e = _restart(root, layout)
    res = e.cache.lookup(e.cache.keys(PROMPT), DOM)
    assert e.cache.begin_restore(res)
    e.cache.end_restore(res, False)
    assert sorted(a.link_id for a in e.cache.drain_dropped()) == sorted(res.plan.link_ids)
    assert len(e.tree) == 0


def test_negative_control_other_bytes_are_caught(written, layout, tmp_path_factory):
    """The round trip's comparison does catch a wrong restore: files of the same prompt written
    from other bytes (another seed) restore cleanly (valid CRCs) and differ from `expected`."""
    _, _, expected = written
    other = tmp_path_factory.mktemp("other")
    e1 = Engine(other, layout)
    e1.capture(PROMPT, seed=1)
    e1.flush()
    e = _restart(other, layout)
    keys = e.cache.keys(PROMPT)
    res = e.cache.lookup(keys, DOM)
    assert res.hit and e.cache.begin_restore(res)
    stage_chain(e.store, res.plan.chain, e.cache.sources(res), FP, key=TEST_KEY)
    assert e.restore_bytes(res.plan.chain) != expected


def test_ram_wins_a_tie_and_disk_serves_only_deeper(written, layout):
    root, _, _ = written
    e = _restart(root, layout)
    e.capture(PROMPT[:200])  # RAM holds 64 and 128
    keys = e.cache.keys(PROMPT)
    res = e.cache.lookup(keys, DOM, 200)
    assert (res.tier, res.tokens) == ("ram", 128)  # the disk has 128 too: RAM serves it
    res = e.cache.lookup(keys, DOM)
    assert (res.tier, res.tokens) == ("disk", 256)


@pytest.mark.parametrize("part", ["header", "section", "view"])
def test_a_flipped_byte_is_a_counted_miss_and_deletes_the_longer_links(written, layout, part):
    root, _, _ = written
    files = {int(p.name.rsplit("-", 1)[1].split(".")[0]): p for p in _files(root)}
    victim = files[128]
    from vllm_hybridcache.core.linkformat.linkfile import read_header

    header, base = read_header(victim, FP, TEST_KEY)
    entry = {"section": header.parts[0], "view": header.parts[-1]}.get(part)
    offset = 60 if entry is None else base + entry.offset + entry.nbytes // 2
    raw = bytearray(victim.read_bytes())
    raw[offset] ^= 0x40
    victim.write_bytes(bytes(raw))

    e = _restart(root, layout)
    keys = e.cache.keys(PROMPT)
    res = e.cache.lookup(keys, DOM)
    if part == "header":  # found by the header's CRC: the scan at start deleted 128 and 256
        assert (res.tier, res.tokens) == ("disk", 64)
        assert e.directory.stats.refused == {"checksum": 1}
    else:  # headers are fine: the parts' CRC fails while staging
        assert res.tokens == 256 and e.cache.begin_restore(res)
        with pytest.raises(DiskReadError) as err:
            stage_chain(e.store, res.plan.chain, e.cache.sources(res), FP, key=TEST_KEY)
        assert err.value.problem == "checksum"
        assert err.value.link_id == res.plan.chain[1].link_id
        assert len(e.store) == 0  # the root link staged before it was dropped again
        e.writer.note_read_failure(err.value.problem)
        e.cache.end_restore(res, False)
        e.cache.invalidate([LinkAddr("disk", "tree", err.value.link_id)])
        forget, _ = e.disk.take_writer_ops()
        assert set(forget) == {str(files[c]) for c in (128, 256)}
        e.disk.absorb_worker(e.writer.snapshot())
        st = e.cache.stats()[("disk", "tree")]
        assert st.misses.get("checksum") == 1 and st.restores_failed == 1
    assert [p.name.endswith("-64.link") for p in _files(root)] == [True]  # the root survives
    res = e.cache.lookup(keys, DOM)
    assert (res.tier, res.tokens) == ("disk", 64)
    assert e.cache.begin_restore(res)
    stage_chain(e.store, res.plan.chain, e.cache.sources(res), FP, key=TEST_KEY)  # still serves


def test_truncated_file_foreign_file_and_unrelated_file(written, layout):
    root, _, _ = written
    files = _files(root)
    deepest = next(p for p in files if p.name.endswith("-256.link"))
    deepest.write_bytes(deepest.read_bytes()[:-100])
    # a file of another fingerprint placed among ours, and an unrelated file
    foreign = files[0].parent / ("ab" * 16 + "-999.link")
    other = Engine(root / "elsewhere", layout, fp=b"G" * 32)
    other.capture(PROMPT[:70])
    other.flush()
    os.replace(_files(root / "elsewhere")[0], foreign)
    unrelated = files[0].parent / "notes.txt"
    unrelated.write_text("not a link")
    e = _restart(root, layout)
    assert e.directory.stats.refused == {"truncated": 1, "foreign": 1}
    assert not deepest.exists() and not foreign.exists()
    assert unrelated.read_text() == "not a link"
    res = e.cache.lookup(e.cache.keys(PROMPT), DOM)
    assert (res.tier, res.tokens) == ("disk", 128)
    st = e.cache.stats()[("disk", "tree")]
    assert st.misses == {"truncated": 1, "foreign": 1}


def test_a_file_truncated_after_the_lookup_fails_the_read(written, layout):
    root, _, _ = written
    e = _restart(root, layout)
    res = e.cache.lookup(e.cache.keys(PROMPT), DOM)
    assert e.cache.begin_restore(res)
    src = e.cache.sources(res)
    Path(src[2]).write_bytes(Path(src[2]).read_bytes()[:5000])
    with pytest.raises(DiskReadError) as err:
        stage_chain(e.store, res.plan.chain, src, FP, key=TEST_KEY)
    assert err.value.problem == "truncated"
    Path(src[1]).unlink()
    with pytest.raises(DiskReadError) as err:
        stage_chain(e.store, res.plan.chain, src, FP, key=TEST_KEY)
    assert err.value.problem == "gone" and len(e.store) == 0


def test_gone_between_lookup_and_begin_is_an_evicted_miss(written, layout):
    root, _, _ = written
    e = _restart(root, layout)
    res = e.cache.lookup(e.cache.keys(PROMPT), DOM)
    _files(root)[0].unlink()
    assert not e.cache.begin_restore(res)
    assert e.cache.stats()[("disk", "tree")].misses == {"evicted": 1}


def test_tagged_lookups_and_untagged_files_never_meet(written, layout):
    """Files of the AR route (no draft tag) never serve a lookup with a draft-row predicate
    (the MTP route's), whatever the predicate says; the MTP route's tagged files are tested in
    test_core_disk_tags.py."""
    root, _, _ = written
    e = _restart(root, layout)
    res = e.disk.lookup(e.cache.keys(PROMPT), DOM, fits=lambda p, tag: True)
    assert not res.hit
    assert e.disk.lookup(e.cache.keys(PROMPT), DOM).hit


def test_existing_files_are_not_written_again_and_clear_deletes_them(written, layout):
    root, _, _ = written
    e = _restart(root, layout)
    keys = e.tree.keys(PROMPT)
    r = e.tree.reserve(keys, 64, DOM)
    e.tree.commit(r.link_id)
    assert e.disk.write_job(e.tree.link_record(r.link_id)) is None  # the file exists
    assert e.cache.clear(tier="disk") == 3
    assert _files(root) == [] and len(e.tree) == 1  # RAM untouched
    assert e.disk.take_writer_ops() == ([], True)
    assert not e.disk.lookup(e.cache.keys(PROMPT), DOM).hit


def test_a_link_committed_while_a_clear_is_queued_is_written_again(written, layout):
    """A clear deletes the files here and queues the writer's own clear behind its queued
    writes; an older write landing between the two leaves a file the writer's clear then
    deletes. A link committed meanwhile must not trust that file: it is written (behind the
    writer's clear), and once the writer reports the clear done, a file there is trusted
    again. Negative control: the file exists, so without the clear in flight no job comes."""
    root, _, _ = written
    e = _restart(root, layout)
    keys = e.tree.keys(PROMPT)
    r = e.tree.reserve(keys, 64, DOM)
    e.tree.commit(r.link_id)
    record = e.tree.link_record(r.link_id)
    assert e.disk.write_job(record) is None                  # on disk: not written again
    e.cache.clear(tier="disk")
    path = e.disk.dir.path_for(DOM, 64, keys.digest(64))    # an older write lands after it
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"an older write")
    assert e.disk.write_job(record) is not None              # clear decided, not yet sent
    assert e.disk.take_writer_ops()[1]                       # the writer's clear is sent
    assert e.disk.write_job(record) is not None              # sent, not yet reported done
    e.writer.clear()
    e.flush()                                                # the writer's report: 1 clear
    assert e.writer.snapshot()["clears"] == 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"a file there now")
    assert e.disk.write_job(record) is None                  # trusted again


def test_writer_drops_writes_when_behind_and_keeps_buffers_busy(tmp_path, layout):
    gate = threading.Event()

    def slow_dir(target):
        gate.wait(10)
        d = LinkDirectory(Path(target.root), target.fingerprint, target.budget_bytes, key=TEST_KEY)
        d.open()
        return d

    w = LinkWriter(DiskTarget(str(tmp_path), FP, 1 << 30, 0, 0.0, key_file=str(KEY_FILE)),
                   max_queue=2, directory=slow_dir)
    keys = PromptKeys(PROMPT)
    store = LinkStore(layout, pin_memory=False)
    accepted = []
    for i, c in enumerate(CUTS):
        start = CUTS[i - 1] if i else 0
        b = store.allocate(i + 1, layout.view_rows(start, c))
        job = WriteJob(i + 1, DOM, keys.digest(c), keys.digest(start) if start else b"",
                       start, c, keys.token_bytes(start, c), layout.view_rows(start, c))
        accepted.append(w.submit(job, {**b.sections, **b.views}))
    assert accepted == [True, True, False]
    assert w.busy(1) and w.busy(2) and not w.busy(3)
    assert w.snapshot()["dropped"] == 1
    assert not w.idle()  # two writes wait for the directory
    gate.set()
    assert w.close(30)
    assert w.idle()
    assert sorted(w.take_done()) == [1, 2] and not w.busy(1)
    snap = w.snapshot()
    assert (snap["writes"], snap["files"]) == (2, 2)
    assert snap["write_seconds"]["count"] == 2


def test_writer_without_a_directory_skips_and_counts(tmp_path, layout):
    def broken(target):
        raise PermissionError("read-only")

    w = LinkWriter(DiskTarget(str(tmp_path), FP, 1 << 30, 0, 0.0, key_file=str(KEY_FILE)),
                   directory=broken)
    keys = PromptKeys(PROMPT)
    store = LinkStore(layout, pin_memory=False)
    b = store.allocate(1, layout.view_rows(0, 64))
    w.submit(WriteJob(1, DOM, keys.digest(64), b"", 0, 64, keys.token_bytes(0, 64),
                      layout.view_rows(0, 64)), {**b.sections, **b.views})
    assert w.close(30)
    snap = w.snapshot()
    assert snap["skips"] == {"no_directory": 1} and "read-only" in snap["error"]
    assert w.take_done() == [1]


def test_a_full_file_system_skips_writes_and_counts_them(tmp_path, layout):
    """min_free: a write that would leave less free space is skipped (counted), and a real
    ENOSPC from the file system is counted as disk_full; nothing is half written."""
    import errno

    free = {"bytes": 1 << 40}

    def directory(target):
        d = LinkDirectory(Path(target.root), target.fingerprint, target.budget_bytes,
                          min_free_bytes=1 << 30, free_bytes=lambda p: free["bytes"], key=TEST_KEY)
        d.open()
        return d

    w = LinkWriter(DiskTarget(str(tmp_path), FP, 1 << 30, 1 << 30, 0.0,
                              key_file=str(KEY_FILE)), directory=directory)
    keys = PromptKeys(PROMPT)
    store = LinkStore(layout, pin_memory=False)

    def job(i, s, e):
        b = store.allocate(i, layout.view_rows(s, e))
        return (WriteJob(i, DOM, keys.digest(e), keys.digest(s) if s else b"", s, e,
                         keys.token_bytes(s, e), layout.view_rows(s, e)),
                {**b.sections, **b.views})

    free["bytes"] = (1 << 30) + 10  # less than a link above the floor
    w.submit(*job(1, 0, 64))
    assert w.close(30)
    assert w.snapshot()["skips"] == {"min_free": 1} and not _files(tmp_path)

    import vllm_hybridcache.core.disk.directory as directory_mod

    def enospc(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    free["bytes"] = 1 << 40
    w = LinkWriter(DiskTarget(str(tmp_path), FP, 1 << 30, 1 << 30, 0.0,
                              key_file=str(KEY_FILE)), directory=directory)
    real = directory_mod.write_link_file
    directory_mod.write_link_file = enospc
    try:
        w.submit(*job(2, 0, 64))
        assert w.close(30)
    finally:
        directory_mod.write_link_file = real
    assert w.snapshot()["skips"] == {"disk_full": 1}
    assert not _files(tmp_path) and not list(tmp_path.rglob(".tmp-*"))


_WRITER_SCRIPT = """
import sys, numpy as np, torch
from pathlib import Path
from vllm_hybridcache.core.disk import LinkDirectory
from vllm_hybridcache.core.auth import key_from_file
from vllm_hybridcache.core.keys import PromptKeys
root, fp, dom = Path(sys.argv[1]), bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
d = LinkDirectory(root, fp, 1 << 40, key=key_from_file(sys.argv[4], "disk"))
d.open()
i = 0
while True:
    toks = np.arange(i * 64, i * 64 + 64, dtype=np.int64)
    keys = PromptKeys(toks)
    parts = {"a": torch.full((1 << 20,), float(i)), "b": torch.full((64, 256), float(i))}
    d.write(domain=dom, digest=keys.digest(64), parent_digest=b"", start=0, end=64,
            tokens=toks, rows=64, parts=parts, nbytes=(1 << 22) + 64 * 1024)
    print(i, flush=True)
    i += 1
"""


def test_kill_9_during_writes_never_leaves_a_torn_link_file(tmp_path):
    """A writer killed with SIGKILL at an arbitrary moment: every `.link` file left is complete
    and verifies; what was cut short is a temporary, swept at the next open."""
    import signal
    import subprocess
    import sys
    import time

    from vllm_hybridcache.core.linkformat.linkfile import read_header, read_parts

    for delay in (0.8, 1.3):
        root = tmp_path / f"run-{delay}"
        proc = subprocess.Popen([sys.executable, "-c", _WRITER_SCRIPT, str(root), FP.hex(),
                                 DOM.hex(), str(KEY_FILE)], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()  # one file is written: the loop is running
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        d = LinkDirectory(root, FP, 1 << 40, tmp_max_age_s=0, key=TEST_KEY)
        d.open()
        assert d.stats.refused == {} and len(d) >= 1
        for path in _files(root):
            header, base = read_header(path, FP, TEST_KEY)
            dst = {"a": torch.empty(1 << 20), "b": torch.empty(64, 256)}
            read_parts(path, header, base, dst, TEST_KEY)  # raises on any torn or damaged part
            assert float(dst["a"][0]) == float(dst["b"][-1, -1])
        assert not list(root.rglob(".tmp-*"))  # swept (age limit 0 here)
