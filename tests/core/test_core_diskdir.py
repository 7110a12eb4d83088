"""The disk tier's directory: chains found by name, verified, evicted leaf-first, shared safely."""

from __future__ import annotations

import fcntl
import os
import shutil

import numpy as np
import pytest
import torch

from tests.keys import TEST_KEY
from vllm_hybridcache.core.disk.directory import LOCK_NAME, LinkDirectory
from vllm_hybridcache.core.keys import PromptKeys
from vllm_hybridcache.core.linkformat.linkfile import LinkFileProblem

FP = bytes(range(32))
OTHER_FP = bytes(range(1, 33))
DOM = b"D" * 32
PROMPT = np.arange(1000, 1400, dtype=np.int64)
CUTS = [64, 128, 256]


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _dir(root, budget=1 << 30, fp=FP, **kw) -> LinkDirectory:
    d = LinkDirectory(root, fp, budget, **kw, key=TEST_KEY)
    d.open()
    return d


def _parts(end: int, rows: int) -> dict[str, torch.Tensor]:
    return {"state": torch.full((4, 4), float(end)), "kv": torch.full((rows, 32), end % 251,
                                                                      dtype=torch.uint8)}


def _write_chain(d: LinkDirectory, prompt=PROMPT, cuts=CUTS) -> None:
    keys = PromptKeys(prompt)
    start = 0
    for end in cuts:
        parts = _parts(end, (end - start) // 16)
        nbytes = sum(t.numel() * t.element_size() for t in parts.values())
        assert d.write(domain=DOM, digest=keys.digest(end),
                       parent_digest=keys.digest(start) if start else b"", start=start, end=end,
                       tokens=keys.tokens[start:end], rows=(end - start) // 16, parts=parts,
                       nbytes=nbytes)
        start = end


def test_a_chain_is_found_by_name_and_verified(tmp_path):
    d = _dir(tmp_path)
    _write_chain(d)
    d.sanity_check()
    keys = PromptKeys(np.concatenate([PROMPT, [1, 2, 3]]))
    chain = d.lookup(keys, DOM, CUTS, len(keys) - 1)
    assert [h.end for _, h, _ in chain] == [64, 128, 256]
    assert [h.start for _, h, _ in chain] == [0, 64, 128]
    # a prompt that parts at 200 finds the link at 128
    other = PROMPT.copy()
    other[200] = 7
    chain = d.lookup(PromptKeys(other), DOM, CUTS, 399)
    assert [h.end for _, h, _ in chain] == [64, 128]
    # the limit and the domain are honoured
    assert [h.end for _, h, _ in d.lookup(keys, DOM, CUTS, 200)] == [64, 128]
    assert d.lookup(keys, b"E" * 32, CUTS, 399) == []


def test_another_engine_of_the_same_fingerprint_sees_the_files(tmp_path):
    a = _dir(tmp_path)
    _write_chain(a)
    b = _dir(tmp_path)
    assert len(b) == 3
    assert len(b.lookup(PromptKeys(PROMPT), DOM, CUTS, 399)) == 3
    b.sanity_check()


def test_a_missing_middle_link_breaks_the_chain(tmp_path):
    d = _dir(tmp_path)
    _write_chain(d)
    keys = PromptKeys(PROMPT)
    d.path_for(DOM, 128, keys.digest(128)).unlink()
    chain = d.lookup(keys, DOM, CUTS, 399)
    assert [h.end for _, h, _ in chain] == [64]


def test_a_damaged_header_deletes_the_file_and_its_longer_links(tmp_path):
    d = _dir(tmp_path)
    _write_chain(d)
    keys = PromptKeys(PROMPT)
    p128 = d.path_for(DOM, 128, keys.digest(128))
    with open(p128, "r+b") as f:
        f.seek(60)
        b = f.read(1)
        f.seek(60)
        f.write(bytes([b[0] ^ 0xFF]))
    chain = d.lookup(keys, DOM, CUTS, 399)
    assert [h.end for _, h, _ in chain] == [64]  # falls back to the deepest sound chain
    assert not p128.exists() and not d.path_for(DOM, 256, keys.digest(256)).exists()
    assert d.stats.refused == {LinkFileProblem.CHECKSUM.value: 1}
    d.sanity_check()


def test_scan_deletes_foreign_format_and_keeps_unrelated_files(tmp_path):
    d = _dir(tmp_path)
    _write_chain(d)
    keys = PromptKeys(PROMPT)
    sub = d.path_for(DOM, 64, keys.digest(64)).parent
    (sub / "README.txt").write_text("an operator's note")
    truncated = d.path_for(DOM, 256, keys.digest(256))
    os.truncate(truncated, 100)
    d.scan()
    assert (sub / "README.txt").exists()
    assert not truncated.exists()
    assert len(d) == 2 and d.stats.refused == {"truncated": 1}
    d.sanity_check()


def test_stale_temporaries_are_swept_fresh_ones_kept(tmp_path):
    clock = Clock()
    d = _dir(tmp_path, clock=clock, tmp_max_age_s=600)
    _write_chain(d)
    sub = next(p for p in d.dir.iterdir() if p.is_dir())
    old = sub / ".tmp-123-abc-x.link"
    new = sub / ".tmp-124-def-y.link"
    old.write_bytes(b"partial")
    new.write_bytes(b"partial")
    os.utime(old, (clock.t - 3600, clock.t - 3600))
    os.utime(new, (clock.t - 10, clock.t - 10))
    d.scan()
    assert not old.exists() and new.exists()
    assert d.stats.swept_temporaries == 1


def test_foreign_fingerprints_swept_unless_in_use(tmp_path):
    other = _dir(tmp_path, fp=OTHER_FP)
    _write_chain(other)
    mine = _dir(tmp_path)  # the other engine still holds its lock: its files stay
    assert other.dir.exists() and mine.stats.kept_foreign_dirs == 1
    other.close()
    mine2 = _dir(tmp_path)
    assert not other.dir.exists() and mine2.stats.swept_dirs == 1
    assert mine.dir.exists()  # our own directory is never swept, locked by mine and mine2


def test_a_sweep_between_creating_and_locking_our_folder_is_survived(tmp_path, monkeypatch):
    """Another engine's sweep takes its exclusive lock on our fresh `.in-use` before we lock it
    and deletes the folder: the lock we then take is on an unlinked file, so `open` makes the
    folder again and holds the lock on the file that is really there."""
    from vllm_hybridcache.core.disk import directory as directory_mod

    real_fcntl = fcntl
    real_flock = fcntl.flock
    d = LinkDirectory(tmp_path, FP, 1 << 30, key=TEST_KEY)
    sweeps = []

    def flock_after_a_sweep(fd, op):
        if op == real_fcntl.LOCK_SH and not sweeps:
            sweeps.append(fd)
            shutil.rmtree(d.dir)
        return real_flock(fd, op)

    monkeypatch.setattr(directory_mod.fcntl, "flock", flock_after_a_sweep)
    d.open()
    monkeypatch.setattr(directory_mod.fcntl, "flock", real_flock)
    assert sweeps, "the simulated sweep did not run"
    held, at_path = os.fstat(d._lock_fd), os.stat(d.dir / LOCK_NAME)
    assert (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)
    # the lock is real: a sweeper of another fingerprint cannot take our folder now
    fd = os.open(d.dir / LOCK_NAME, os.O_RDWR)
    try:
        with pytest.raises(OSError):
            real_flock(fd, real_fcntl.LOCK_EX | real_fcntl.LOCK_NB)
    finally:
        os.close(fd)
    d.close()


def test_an_unrelated_folder_in_the_root_is_left_alone(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "weights.bin").write_bytes(b"x")
    _dir(tmp_path)
    assert (tmp_path / "models" / "weights.bin").exists()


def test_budget_evicts_least_valuable_leaves_first(tmp_path):
    clock = Clock()
    d = _dir(tmp_path, clock=clock)
    _write_chain(d)  # chain 64 -> 128 -> 256
    other = PROMPT.copy()
    other[100] = 5  # a branch at 64: link at 128 of another prompt
    _write_chain(d, other, [64, 128])
    sizes = {p: e.nbytes for p, e in d._index.items()}
    keys = PromptKeys(PROMPT)
    deep = d.path_for(DOM, 256, keys.digest(256))
    d.touch(deep)  # the deep link was used: worth more
    clock.t += 3600
    d.budget_bytes = sum(sizes.values())
    parts = _parts(64, 4)
    nb = sum(t.numel() * t.element_size() for t in parts.values())
    third = PromptKeys(np.arange(5000, 5100))
    assert d.write(domain=DOM, digest=third.digest(64), parent_digest=b"", start=0, end=64,
                   tokens=third.tokens[:64], rows=4, parts=parts, nbytes=nb)
    branch = d.path_for(DOM, 128, PromptKeys(other).digest(128))
    assert not branch.exists() and deep.exists()  # the unused leaf went, the used one stayed
    assert d.stats.evictions >= 1
    d.sanity_check()
    # a root with children is never evicted before them
    for e in d._index.values():
        if e.parent is not None:
            assert e.parent in d._index


def test_ttl_expires_unused_files_with_their_descendants(tmp_path):
    clock = Clock()
    d = _dir(tmp_path, clock=clock, ttl_s=3600)
    _write_chain(d)
    clock.t += 7200
    d.scan()
    assert len(d) == 0 and d.stats.expired == 3


def test_min_free_space_and_full_disk_skip_writes(tmp_path, monkeypatch):
    d = _dir(tmp_path, min_free_bytes=1 << 40, free_bytes=lambda p: 1 << 30)
    keys = PromptKeys(PROMPT)
    parts = _parts(64, 4)
    assert not d.write(domain=DOM, digest=keys.digest(64), parent_digest=b"", start=0, end=64,
                       tokens=keys.tokens[:64], rows=4, parts=parts, nbytes=1000)
    assert d.stats.writes_skipped == {"min_free": 1}
    d2 = _dir(tmp_path / "b")

    def enospc(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", enospc)
    assert not d2.write(domain=DOM, digest=keys.digest(64), parent_digest=b"", start=0,
                        end=64, tokens=keys.tokens[:64], rows=4, parts=parts, nbytes=1000)
    assert d2.stats.writes_skipped == {"disk_full": 1}
    monkeypatch.undo()
    assert len(d2) == 0
    assert not [p for p in d2.dir.rglob("*") if p.is_file() and p.name != LOCK_NAME]


def test_a_link_larger_than_the_budget_is_skipped(tmp_path):
    d = _dir(tmp_path, budget=100)
    keys = PromptKeys(PROMPT)
    assert not d.write(domain=DOM, digest=keys.digest(64), parent_digest=b"", start=0, end=64,
                       tokens=keys.tokens[:64], rows=4, parts=_parts(64, 4), nbytes=1000)
    assert d.stats.writes_skipped == {"too_large": 1}


def test_clear_deletes_every_link_file(tmp_path):
    d = _dir(tmp_path)
    _write_chain(d)
    assert d.clear() == 3
    assert d.lookup(PromptKeys(PROMPT), DOM, CUTS, 399) == []
    d.sanity_check()


def test_an_unusable_directory_is_a_clear_error(tmp_path):
    """open() raises OSError for a root it cannot create (here: a path under a regular file;
    the same error class as a read-only mount), for the caller to report at start-up."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        _dir(blocker / "cache")


def test_the_shared_lock_is_held_until_close(tmp_path):
    d = _dir(tmp_path)
    fd = os.open(d.dir / LOCK_NAME, os.O_RDWR)
    with pytest.raises(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    d.close()
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


def test_the_eviction_value_is_hits_plus_one_times_tokens_per_byte_halved_per_day():
    from vllm_hybridcache.core.disk.directory import DAY_S, DiskLink

    now = 10 * DAY_S
    base = DiskLink(os.devnull, None, end=1000, nbytes=2000, last_used=now)
    assert base.value(now) == pytest.approx(1 * 1000 / 2000)
    used = DiskLink(os.devnull, None, end=1000, nbytes=2000, last_used=now, hits=3)
    assert used.value(now) == pytest.approx(4 * base.value(now))
    old = DiskLink(os.devnull, None, end=1000, nbytes=2000, last_used=now - 2 * DAY_S, hits=3)
    assert old.value(now) == pytest.approx(used.value(now) / 4)  # two days unused: a quarter
    # more tokens saved per byte held is worth more
    dense = DiskLink(os.devnull, None, end=4000, nbytes=2000, last_used=now)
    assert dense.value(now) == pytest.approx(4 * base.value(now))


def test_a_use_seen_by_another_process_keeps_a_file_from_ttl_and_eviction(tmp_path):
    """Two indexes of one folder (the scheduler's, which serves reads, and the writer's, which
    evicts): a read stamps the file, so the writer's index neither expires it nor takes it
    for unused."""
    clock = Clock()
    writer = _dir(tmp_path, clock=clock, ttl_s=3600)
    _write_chain(writer)
    reader = _dir(tmp_path, clock=clock, ttl_s=3600)
    keys = PromptKeys(PROMPT)
    deep = reader.path_for(DOM, 256, keys.digest(256))
    clock.t += 3000
    for p, _, _ in reader.lookup(keys, DOM, CUTS, 400):
        reader.touch(p)  # the scheduler served the chain
    clock.t += 3000  # past the TTL of the writer's own last use
    writer._make_room(0)  # the writer's housekeeping before a write
    assert deep.exists() and len(writer) == 3 and writer.stats.expired == 0
    clock.t += 4000
    writer._make_room(0)
    assert not deep.exists() and writer.stats.expired == 3


def test_warm_spans_name_the_likeliest_files_first_within_the_limit(tmp_path):
    """What a starting worker warms read buffers for: the files by eviction value, most
    valuable first, each with the token span it holds, as many as the byte limit takes; the
    spans survive a restart (a new directory's scan reads them from the headers)."""
    clock = Clock()
    d = _dir(tmp_path, clock=clock)
    _write_chain(d)  # 0-64, 64-128, 128-256
    keys = PromptKeys(PROMPT)
    for _ in range(3):
        d.touch(d.path_for(DOM, 128, keys.digest(128)))
    by_value = sorted(d._index.values(), key=lambda e: -e.value(clock()))
    assert by_value[0].end == 128  # the used link is worth the most
    everything = d.warm_spans(1 << 30)
    assert everything == [(e.start, e.end) for e in by_value]
    assert sorted(everything) == [(0, 64), (64, 128), (128, 256)]
    first = by_value[0].nbytes
    assert d.warm_spans(first) == [(64, 128)]
    assert d.warm_spans(first - 1) in ([], [(0, 64)])  # only a smaller file may still fit
    assert d.warm_spans(0) == []
    again = _dir(tmp_path, clock=clock)  # a restart: the index rebuilt from the files
    assert sorted(again.warm_spans(1 << 30)) == sorted(everything)
