"""The soak run's in-place check (testing/in_place_check.py), without an engine: a real worker
side's link store and paged-block accessor over a KV tensor of the test's own. Shared blocks
equal to the chain's stored copies pass; a block off by rounding counts as differing; a block
holding other rows counts as gross and fails the soak summary (the negative controls), and
blocks past the shared end are never compared."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks.soak.report import summarize
from tests.adapter.test_unkeyed_inputs import BLOCK, _kv_cache_config
from vllm_hybridcache.adapter.plans import LoadJob
from vllm_hybridcache.core import LinkRef
from vllm_hybridcache.ops.paged_blocks import PagedBlocks
from vllm_hybridcache.testing.in_place_check import GROSS, InPlaceCheck
from vllm_hybridcache.testing.instrumentation import Instrumentation

LINKS = 3 * BLOCK           # the chain: two links, ending at three blocks
BLOCK_IDS = [5, 9, 2]       # the request's attention blocks in the pool


def _worker():
    """A worker side with its attention view's accessor over a KV tensor, and a two-link chain
    whose stored rows are also what the pool's blocks hold (a cold prefill's rows)."""
    from vllm_hybridcache.adapter.worker_side import WorkerSide

    worker = WorkerSide(SimpleNamespace(), _kv_cache_config())
    (name, gid, _), = worker.parts.views
    block_bytes = worker.parts.block_bytes[name]
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(worker.num_blocks, block_bytes // 4, generator=g)
    acc = PagedBlocks(kv, worker.num_blocks, block_bytes)
    worker._rows[name] = (gid, acc)
    store, layout = worker.store, worker.parts.layout
    for link_id, (start, end) in ((7, (0, 2 * BLOCK)), (8, (2 * BLOCK, LINKS))):
        bufs = store.allocate(link_id, layout.view_rows(start, end))
        rows = bufs.views[name]          # raw block bytes: [blocks, block_bytes] uint8
        n = rows.shape[0]
        rows.copy_(torch.randn(n, block_bytes // 4, generator=g).view(torch.uint8).view(rows.shape))
        rows = rows.reshape(n, -1)
        first = start // layout.view_block_tokens
        for i in range(n):               # the pool holds the same rows (float32 K/V values)
            kv[BLOCK_IDS[first + i]].copy_(rows[i].view(kv.dtype))
        for s in bufs.sections.values():
            s.zero_()
        store.seal(link_id)
    block_ids = [[] for _ in worker.kv_cache_groups]
    block_ids[gid] = list(BLOCK_IDS)
    return worker, kv, block_ids


def _job(block_ids, in_place: int) -> LoadJob:
    return LoadJob(req_id="r", tier="ram", kind="tree",
                   chain=(LinkRef(7, 0, 2 * BLOCK), LinkRef(8, 2 * BLOCK, LINKS)),
                   block_ids=block_ids, in_place=in_place)


def test_shared_blocks_equal_to_the_stored_rows_pass():
    worker, _, block_ids = _worker()
    check = InPlaceCheck(worker)
    Instrumentation(in_place_check=check).after_load(_job(block_ids, 2 * BLOCK), 0.01)
    assert check.counts == {"restores": 1, "blocks": 2, "differing": 0, "gross": 0}
    assert check.worst == 0.0
    check(_job(block_ids, 0))            # nothing shared: nothing checked
    assert check.counts["restores"] == 1


def test_a_rounding_difference_differs_and_other_rows_are_gross():
    worker, kv, block_ids = _worker()
    check = InPlaceCheck(worker)
    kv[BLOCK_IDS[1]][3] += 2e-6          # a batch's last bits
    check(_job(block_ids, 2 * BLOCK))
    assert check.counts["differing"] == 1 and check.counts["gross"] == 0
    assert 0 < check.worst < GROSS
    kv[BLOCK_IDS[0]].copy_(kv[40])       # another computation's rows
    check(_job(block_ids, 2 * BLOCK))
    assert check.counts["differing"] == 3 and check.counts["gross"] == 1
    assert check.worst > GROSS


def test_blocks_past_the_shared_end_are_never_compared():
    worker, kv, block_ids = _worker()
    check = InPlaceCheck(worker)
    kv[BLOCK_IDS[2]].add_(1.0)           # the request's own block: the restore writes it
    check(_job(block_ids, 2 * BLOCK))
    assert check.counts == {"restores": 1, "blocks": 2, "differing": 0, "gross": 0}
    check(_job(block_ids, LINKS))        # shared up to the chain's end: now it is compared
    assert check.counts["gross"] == 1


def _summary(counters: dict[str, float]) -> dict:
    return summarize([], [], [{"t": 1.0, "life": 1, "rss": 0, **counters}], wall_s=1.0,
                     startups=[1.0], kinds=(), rss_bound_mib_per_min=16.0, min_window_s=300.0)


def test_a_gross_block_fails_the_soak_summary():
    ok = _summary({"in_place_restores": 4, "in_place_blocks": 30, "in_place_differing": 2,
                   "in_place_gross": 0})
    assert ok["verdict"] == "pass" and ok["cache"]["in_place_blocks"] == 30
    bad = _summary({"in_place_restores": 4, "in_place_blocks": 30, "in_place_differing": 2,
                    "in_place_gross": 1})
    assert bad["verdict"] == "fail"
    assert any("served in place held other rows" in r for r in bad["reasons"])
