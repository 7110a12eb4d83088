"""One link, one file per tensor-parallel rank (core/linkformat/shard.py, core/disk/sharded.py),
without an engine: where each rank's files are, what a rank's header carries, and the
scheduler side's view of the ranks' folders as one directory of whole links."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from tests.core.test_core_diskdir import CUTS, DOM, FP, OTHER_FP, PROMPT, _write_chain
from tests.keys import TEST_KEY
from vllm_hybridcache.core.disk.directory import LinkDirectory
from vllm_hybridcache.core.disk.sharded import ShardedDirectory
from vllm_hybridcache.core.keys import PromptKeys
from vllm_hybridcache.core.linkformat.linkfile import LinkFileError, read_header
from vllm_hybridcache.core.linkformat.shard import Shard, relocate

KEYS = PromptKeys(PROMPT)


def _rank(root, rank: int, world: int = 2, budget: int = 1 << 30, fp: bytes = FP):
    d = LinkDirectory(root, fp, budget, key=TEST_KEY, shard=Shard(rank, world))
    d.open()
    return d


def _both(root, world: int = 2) -> tuple[ShardedDirectory, list[LinkDirectory]]:
    """The scheduler side's view and each rank's writer, every rank holding the chain."""
    writers = [_rank(root, r, world) for r in range(world)]
    for w in writers:
        _write_chain(w)
    view = ShardedDirectory([_rank(root, r, world) for r in range(world)])
    return view, writers


def test_a_rank_s_files_sit_in_its_folder_under_the_same_names(tmp_path):
    zero, one = _rank(tmp_path, 0), _rank(tmp_path, 1)
    assert zero.home == one.home and zero.dir != one.dir
    assert (zero.dir.name, one.dir.name) == ("shard-0-of-2", "shard-1-of-2")
    p = zero.path_for(DOM, 64, KEYS.digest(64))
    assert relocate(p, 1, 2) == one.path_for(DOM, 64, KEYS.digest(64))
    assert relocate(p, 0, 1) == p                    # one worker: the path itself
    with pytest.raises(ValueError):
        relocate(p, 1, 4)                            # not a folder of 4 ranks
    # one worker: the layout of before (files in the fingerprint's folder)
    solo = LinkDirectory(tmp_path, FP, 1 << 30, key=TEST_KEY)
    assert solo.dir == solo.home == zero.home and solo.fingerprint == FP
    with pytest.raises(ValueError):
        Shard(2, 2)


def test_each_rank_s_header_carries_the_engine_s_fingerprint_and_its_shard(tmp_path):
    zero, one = _rank(tmp_path, 0), _rank(tmp_path, 1)
    assert zero.fingerprint == one.fingerprint == FP
    assert (zero.shard.tag, one.shard.tag, Shard().tag) == ("0/2", "1/2", "")
    _write_chain(one)
    f = one.path_for(DOM, 64, KEYS.digest(64))
    header, _ = read_header(f, FP, TEST_KEY, tmp_path, "1/2")
    assert header.shard == "1/2"
    for other in ("0/2", ""):                        # rank 0's reader, a one-worker reader
        with pytest.raises(LinkFileError, match="foreign"):
            read_header(f, FP, TEST_KEY, tmp_path, other)


def test_the_ranks_share_the_fingerprint_folder_and_no_sweep_takes_a_rank_s(tmp_path):
    _both(tmp_path)
    other = LinkDirectory(tmp_path, OTHER_FP, 1 << 30, key=TEST_KEY)
    other.open()                                     # sweeps folders nobody holds
    assert other.stats.kept_foreign_dirs == 1 and other.stats.swept_dirs == 0
    assert len(_rank(tmp_path, 1)) == 3              # rank 1's files are all there


def test_a_chain_is_whole_only_up_to_the_first_link_a_rank_lacks(tmp_path):
    view, writers = _both(tmp_path)
    assert [h.end for _, h, _ in view.lookup(KEYS, DOM, CUTS, 399)] == [64, 128, 256]
    os.unlink(writers[1].path_for(DOM, 256, KEYS.digest(256)))
    assert [h.end for _, h, _ in view.lookup(KEYS, DOM, CUTS, 399)] == [64, 128]
    assert not view.has_file(view.path_for(DOM, 256, KEYS.digest(256)))
    assert view.has_file(view.path_for(DOM, 128, KEYS.digest(128)))
    os.unlink(writers[1].path_for(DOM, 64, KEYS.digest(64)))
    assert view.lookup(KEYS, DOM, CUTS, 399) == []


def test_another_rank_s_file_under_a_rank_s_name_is_refused_on_every_rank(tmp_path):
    view, writers = _both(tmp_path)
    name = writers[0].path_for(DOM, 128, KEYS.digest(128))
    shutil.copyfile(name, relocate(name, 1, 2))      # rank 0's shard where rank 1's belongs
    assert [h.end for _, h, _ in view.lookup(KEYS, DOM, CUTS, 399)] == [64]
    assert sum(view.stats.refused.values()) == 1
    for r in range(2):                               # the link and its longer one, everywhere
        for end in (128, 256):
            assert not relocate(view.path_for(DOM, end, KEYS.digest(end)), r, 2).exists()


def test_deletes_evictions_and_clears_reach_every_rank(tmp_path):
    view, _ = _both(tmp_path)
    told: list = []
    view.on_delete = told.append
    deepest = view.path_for(DOM, 256, KEYS.digest(256))
    assert view.delete([deepest]) == 1
    assert told == [deepest]                         # the writer's index hears rank 0's path
    assert not relocate(deepest, 1, 2).exists()
    assert view.evict(0) == 0 and len(view.first) == 2   # nothing asked, nothing evicted
    assert view.evict(1) > 0                         # a leaf of rank 0, and rank 1's with it
    assert len(view.first) == len(view.shards[1]) == 1
    view.clear()
    assert len(view.first) == len(view.shards[1]) == 0
    assert not any(p.suffix == ".link" for p in tmp_path.rglob("*"))
    view.sanity_check()


def test_stats_count_links_once_and_bytes_of_every_rank(tmp_path):
    view, _ = _both(tmp_path)
    assert view.stats.files == 3 and len(view) == 3
    assert view.stats.bytes == sum(s.stats.bytes for s in view.shards)
    assert view.budget_bytes == 2 << 30
    assert np.all([s.stats.files == 3 for s in view.shards])
