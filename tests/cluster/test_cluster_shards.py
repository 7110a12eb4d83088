"""The cluster tier at tensor parallel size 2, without Ray or vLLM (issue 30, item 4).

Each rank's worker publishes its own shard of every link under its own locator, the payload's
header carrying the rank's shard tag (authenticated). Another replica of the same shape serves
a chain only when every rank's payload of every link in it is listed, fetched and verified;
each rank's worker then reads its own rank's staged file. Checked: every rank restores its
own bytes (not the other rank's); a rank's entry missing serves a shallower chain or none; a
payload of the wrong rank under a rank's locator is a counted miss serving nothing; a damaged
rank-1 part fails that rank's read; a replica of another TP size finds nothing."""

from __future__ import annotations

import pytest

from tests.cluster.fakes import DOM, PROMPT, FakeCluster, Replica
from tests.core.link_bytes import restored_bytes
from vllm_hybridcache.core.linkformat.reader import DiskReadError
from vllm_hybridcache.core.linkformat.shard import Shard
from vllm_hybridcache.core.tiers.cluster import ClusterMiss, locator


@pytest.fixture
def pair(tmp_path, layout):
    c = FakeCluster()
    a = Replica(c, "a", layout, tmp_path, shards=2)
    b = Replica(c, "b", layout, tmp_path, shards=2)
    a.capture(PROMPT)
    return c, a, b


def _expected(replica: Replica) -> list[dict[str, bytes]]:
    chain = replica.tree.lookup(replica.tree.keys(PROMPT), DOM).plan.chain
    return [restored_bytes(store, chain) for store in replica.stores]


def _loc(a: Replica, end: int, rank: int) -> bytes:
    return locator(a.key, a.fp, DOM, a.tree.keys(PROMPT).digest(end), Shard(rank, 2).tag)


def test_every_rank_restores_its_own_shard(pair):
    c, a, b = pair
    expected = _expected(a)
    assert expected[0] != expected[1]  # sensitivity: the ranks hold different bytes
    assert len(c.entries) == 2 * 3     # 3 links, one entry per rank
    _, res = b.lookup(PROMPT)
    assert res.hit and res.tier == "cluster" and res.tokens == 256
    # every rank's file of a link staged under one name in the rank's folder
    staged = [sorted(p.name for p in (b.tmp / "stage" / Shard(r, 2).folder).iterdir())
              for r in range(2)]
    assert len(staged[0]) == 3 and staged[0] == staged[1]
    assert b.serve_ranks(res) == expected
    b.cache.sanity_check()
    assert b.tier.bytes_held == 0
    assert not any(p.is_file() for p in (b.tmp / "stage").rglob("*"))  # every file gone


@pytest.mark.parametrize("missing,tokens", [(256, 128), (64, 0)])
def test_a_rank_entry_missing_serves_the_chain_above_it(pair, missing, tokens):
    c, a, b = pair
    del c.entries[_loc(a, missing, 1)]
    _, res = b.lookup(PROMPT)
    assert res.tokens == tokens
    if tokens:
        assert res.hit and [(r.start, r.end) for r in res.plan.chain] == [(0, 64), (64, 128)]
        # shallower: a's restore of the same two links, on each rank
        chain = a.tree.lookup(a.tree.keys(PROMPT[:129]), DOM, 128).plan.chain
        assert b.serve_ranks(res) == [restored_bytes(s, chain) for s in a.stores]
    else:
        assert not res.hit


def test_another_ranks_payload_under_a_ranks_locator_is_refused(pair):
    """A directory (or replica) that lists rank 0's payload where rank 1's should be: the
    header's shard tag is authenticated, so the payload is foreign to rank 1."""
    c, a, b = pair
    rank0 = c.entries[_loc(a, 256, 0)]
    loc1 = _loc(a, 256, 1)
    c.entries[loc1] = rank0._replace(locator=loc1, parent_locator=_loc(a, 128, 1))
    _, res = b.lookup(PROMPT)
    assert not res.hit
    assert b.tier.stats().misses.get(ClusterMiss.FOREIGN.value) == 1
    assert loc1 in c.forgotten  # the bad entry leaves the directory
    assert not any(p.is_file() for p in (b.tmp / "stage").rglob("*"))


def test_a_damaged_part_of_one_rank_fails_that_ranks_read(pair):
    """Negative control: a flipped byte in rank 1's payload of the deepest link passes the
    scheduler side's header checks and is refused by rank 1's CRC check; the restore fails
    as a whole (vLLM then recomputes on every rank)."""
    c, a, b = pair
    h = c.entries[_loc(a, 256, 1)].handle
    data = bytearray(c.objects[h])
    data[-100] ^= 0xFF
    c.objects[h] = bytes(data)
    _, res = b.lookup(PROMPT)
    assert res.hit
    with pytest.raises(DiskReadError):
        b.serve_ranks(res)
    assert b.tier.stats().restores_failed == 1


def test_replicas_of_another_tensor_parallel_size_share_nothing(tmp_path, layout):
    c = FakeCluster()
    a = Replica(c, "a", layout, tmp_path, shards=2)
    one = Replica(c, "one", layout, tmp_path)
    a.capture(PROMPT)
    _, res = one.lookup(PROMPT)
    assert not res.hit and res.tokens == 0
    assert one.tier.stats().misses.get(ClusterMiss.FOREIGN.value) is None  # never fetched
