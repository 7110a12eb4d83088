"""The disk tier at tensor parallel size 2 (core/disk/sharded.py), on vLLM's real scheduler
with two fake workers that each hold their own shard of every state (tests/harness/engine.py).

One link on disk is one file per rank, each written by its own worker under the same name in
its rank's folder, each header carrying its rank's shard tag. Checked: a disk hit restores
both ranks exactly (the negative control corrupts rank 1's restore and the comparison fails);
a link is served only while both ranks' files are there (one missing: a shallower hit or a
miss, exact either way); a rank's file that fails when its worker reads it fails the load on
every rank, is counted by its problem and deleted on every rank; a rank's file replaced by
another rank's is refused; a restarted engine serves from the files.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.harness.engine import HarnessEngine, cache_stats
from vllm_hybridcache.core.linkformat.linkfile import LinkFileError, read_header

GRID = 64
A = [100 + (i * 7) % 3000 for i in range(3 * GRID + 20)]          # cuts at 64, 128, 192


def engine(tmp_path: Path, **kw) -> HarnessEngine:
    e = HarnessEngine({"disk_dir": str(tmp_path / "disk"),
                       "disk_key_file": str(tmp_path / "disk.key"),
                       "disk_write_first_tokens": 0, **kw}, workers=2)
    # the fake model's prefill costs nothing, so the read-cost rule (a disk hit only when its
    # read beats the prefill it saves, tests/core/test_core_disk_cost.py) would refuse every
    # hit at a measured rate that depends on the machine's load: weighed off here
    e.connector._sched.cache.tier("disk", "tree").cost = None
    return e


def shard_files(tmp_path: Path) -> dict[int, dict[str, Path]]:
    """rank -> {file name relative to its rank folder: path}."""
    out: dict[int, dict[str, Path]] = {0: {}, 1: {}}
    for p in (tmp_path / "disk").rglob("*.link"):
        shard = next(x for x in p.parts if x.startswith("shard-"))
        rank = int(shard.split("-")[1])
        out[rank][str(p.relative_to(next(q for q in p.parents if q.name == shard)))] = p
    return out


def written(e: HarnessEngine, tmp_path: Path, n: int, timeout_s: float = 30.0) -> dict:
    """Step the engine (idle steps) until both ranks' writers put `n` files each."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = shard_files(tmp_path)
        if all(len(f) >= n for f in files.values()):
            return files
        time.sleep(0.05)
        e.run([5] * 3, max_tokens=1)
    raise AssertionError(f"the writers did not write {n} files each: {shard_files(tmp_path)}")


def rank1_digests(e: HarnessEngine, run) -> list[str]:
    return [d for k, d in e.instrumentation[1].digests.items() if run.req_id in str(k)]


@pytest.fixture
def cold_a():
    ref = HarnessEngine(workers=2)
    run = ref.run(A)
    return run, rank1_digests(ref, run)


def test_each_rank_writes_its_own_file_of_every_link(tmp_path):
    e = engine(tmp_path)
    e.run(A)
    files = written(e, tmp_path, 3)
    assert set(files[0]) == set(files[1]) and len(files[0]) == 3   # same names, both ranks
    dirs = e.connector._sched.cache.tier("disk", "tree").dir.shards
    for name in files[0]:
        zero, one = files[0][name], files[1][name]
        assert zero.read_bytes() != one.read_bytes()               # each rank's own shard
        d = dirs[1]
        assert read_header(one, d.fingerprint, d.key, d.root, "1/2")[0].shard == "1/2"
        with pytest.raises(LinkFileError):                         # not rank 0's
            read_header(one, d.fingerprint, d.key, d.root, "0/2")
    on_disk = sum(p.stat().st_size for f in files.values() for p in f.values())
    deadline = time.monotonic() + 30.0   # both writers' reports reach the scheduler side
    while cache_stats(e, tier="disk")["capture_bytes"] < on_disk and time.monotonic() < deadline:
        e.run([5] * 3, max_tokens=1)
    s = cache_stats(e, tier="disk")
    assert s["captures"] == 3 and s["links"] == 3      # links: rank 0 counts one per link
    assert s["capture_bytes"] == s["bytes_held"] == on_disk   # bytes: every rank's


def test_a_disk_hit_restores_every_rank_exactly(tmp_path, cold_a):
    ref, ref1 = cold_a
    e = engine(tmp_path)
    e.run(A)
    written(e, tmp_path, 3)
    e.connector._sched.clear(tier="ram")
    warm = e.run(A)
    assert warm.cached == 3 * GRID
    assert warm.tokens == ref.tokens and warm.state == ref.state
    assert rank1_digests(e, warm) == ref1
    assert cache_stats(e, tier="disk")["restores"] == 1
    # negative control: rank 1's restore off by one value fails that comparison
    e.connector._sched.clear(tier="ram")
    e.corrupt_restores(rank=1)
    bad = e.run(A)
    e.corrupt_restores(False, rank=1)
    assert bad.cached == 3 * GRID and rank1_digests(e, bad) != ref1


def test_a_link_is_served_only_while_every_rank_holds_its_file(tmp_path, cold_a):
    ref, ref1 = cold_a
    e = engine(tmp_path)
    e.run(A)
    files = written(e, tmp_path, 3)
    by_end = {int(n.rsplit("-", 1)[1].removesuffix(".link")): n for n in files[1]}
    files[1][by_end[3 * GRID]].unlink()             # rank 1 lost its deepest file
    e.connector._sched.clear(tier="ram")
    warm = e.run(A)
    assert warm.cached == 2 * GRID                   # the whole links below it serve
    assert warm.tokens == ref.tokens and rank1_digests(e, warm) == ref1
    files[1][by_end[GRID]].unlink()                  # and now the root
    e.connector._sched.clear(tier="ram")
    none = e.run(A)
    assert none.cached == 0 and none.tokens == ref.tokens and rank1_digests(e, none) == ref1


def test_a_rank_file_that_fails_its_read_is_a_counted_miss_on_every_rank(tmp_path, cold_a):
    ref, ref1 = cold_a
    e = engine(tmp_path)
    e.run(A)
    files = written(e, tmp_path, 3)
    victim = files[1][max(files[1], key=lambda n: int(n.rsplit("-", 1)[1][:-5]))]
    raw = bytearray(victim.read_bytes())
    raw[-10] ^= 0xFF                                 # a payload byte: the header still verifies
    victim.write_bytes(bytes(raw))
    e.connector._sched.clear(tier="ram")
    out = e.run(A)
    assert out.tokens == ref.tokens and out.state == ref.state    # recomputed on both ranks
    assert rank1_digests(e, out) == ref1
    s = cache_stats(e, tier="disk")
    assert s["restores_failed"] == 1 and s["invalidated"] >= 1
    assert s["misses"].get("checksum", 0) + s["misses"].get("unauthenticated", 0) == 1
    # the damaged set was deleted and the cold run wrote it again, whole: the next disk hit
    # serves every rank exactly
    written(e, tmp_path, 3)
    e.connector._sched.clear(tier="ram")
    warm = e.run(A)
    assert warm.cached == 3 * GRID
    assert warm.tokens == ref.tokens and rank1_digests(e, warm) == ref1


def test_a_file_of_another_rank_is_refused(tmp_path, cold_a):
    ref, ref1 = cold_a
    e = engine(tmp_path)
    e.run(A)
    files = written(e, tmp_path, 3)
    for name, p in files[1].items():
        shutil.copyfile(files[0][name], p)           # rank 0's shards where rank 1's belong
    e.connector._sched.clear(tier="ram")
    out = e.run(A)
    assert out.cached == 0
    assert out.tokens == ref.tokens and rank1_digests(e, out) == ref1
    assert sum(cache_stats(e, tier="disk")["misses"].values()) >= 1   # refused, counted


def test_a_restarted_engine_serves_from_every_rank_s_files(tmp_path, cold_a):
    ref, ref1 = cold_a
    first = engine(tmp_path)
    first.run(A)
    written(first, tmp_path, 3)
    again = engine(tmp_path)
    assert cache_stats(again, tier="disk")["links"] == 3
    warm = again.run(A)
    assert warm.cached == 3 * GRID
    assert warm.tokens == ref.tokens and warm.state == ref.state
    assert rank1_digests(again, warm) == ref1


def test_an_end_anchor_spilled_by_eviction_serves_every_rank_from_its_files(tmp_path):
    """Session spill at TP = 2: an end anchor RAM evicts is written by each rank's writer
    (kind `anchor`), and the next turn of its conversation resumes from both ranks' files,
    exact on each rank (the fake model's decode computes what its prefill would)."""
    e = engine(tmp_path, session_anchors=1)
    e.connector._sched.cache.tier("disk", "anchor").cost = None   # as `engine` does
    first = e.run(A[:100], max_tokens=4)
    turn = A[:100] + first.tokens + [7, 8, 9, 10, 11]
    e.run([900 + i for i in range(90)], max_tokens=4)     # its anchor evicts the first's
    deadline = time.monotonic() + 30.0
    while (min(len([p for p in f.values() if p.parent.name.startswith("a-")])
               for f in shard_files(tmp_path).values()) < 1 and time.monotonic() < deadline):
        e.run([5] * 3, max_tokens=1)
    ref = HarnessEngine(workers=2)
    cold = ref.run(turn)
    e.connector._sched.clear(tier="ram")
    warm = e.run(turn)
    assert warm.cached == 100 + len(first.tokens) - 1
    assert warm.tokens == cold.tokens and warm.state == cold.state
    assert rank1_digests(e, warm) == rank1_digests(ref, cold)
    assert cache_stats(e, "anchor", tier="disk")["hits"] == 1
