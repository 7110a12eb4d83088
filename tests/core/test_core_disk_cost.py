"""The disk tier's cost check (core/disk/cost.py), without vLLM: a disk hit is taken only when
reading its chain costs less than prefilling the tokens beyond RAM's hit, from measured rates."""

from __future__ import annotations

import numpy as np
import pytest

from tests.core.test_core_disk_tier import DOM, PROMPT, Engine
from vllm_hybridcache.core.disk.cost import ReadCost


def test_measurements_replace_the_priors_then_average():
    c = ReadCost(read_bytes_per_s=1e9, prefill_tokens_per_s=2000, alpha=0.5)
    assert c.worth(10**9, 2001) and not c.worth(10**9, 2000)  # 1 s read vs 1.0005 s prefill
    c.observe_read(10**8, 1.0)  # 100 MB/s measured: the prior is dropped
    assert c.read_bytes_per_s == pytest.approx(1e8)
    c.observe_read(3 * 10**8, 1.0)
    assert c.read_bytes_per_s == pytest.approx(2e8)  # EWMA, alpha 0.5
    c.observe_prefill(10_000, 1.0)
    assert c.prefill_tokens_per_s == pytest.approx(10_000)
    c.observe_prefill(0, 1.0)  # empty samples are ignored
    c.observe_read(5, 0.0)
    assert (c.reads_seen, c.prefills_seen) == (2, 1)
    # 200 MB/s, 10K tokens/s: 100 MB (0.5 s) is worth 5,001 tokens, not 5,000 or fewer
    assert c.worth(10**8, 5001) and not c.worth(10**8, 5000) and not c.worth(0, 0)
    with pytest.raises(ValueError):
        ReadCost(alpha=0)


@pytest.fixture
def on_disk(tmp_path, layout):
    e = Engine(tmp_path, layout)
    e.capture(PROMPT)
    e.flush()
    e.directory.close()
    return tmp_path


def _restart(root, layout, cost: ReadCost, ram_depth: int = 0) -> Engine:
    e = Engine(root, layout)
    e.disk.cost = cost
    e.disk._baseline = lambda keys, domain, limit: ram_depth
    return e


def test_a_hit_slower_than_its_prefill_is_a_counted_miss(on_disk, layout):
    chain_bytes = sum(f.stat().st_size for f in on_disk.rglob("*.link"))
    # fast prefill, slow disk: reading the three files (256 tokens) costs more than prefilling
    slow = ReadCost(read_bytes_per_s=chain_bytes / 10, prefill_tokens_per_s=256 / 5)
    e = _restart(on_disk, layout, slow)
    res = e.cache.lookup(e.cache.keys(PROMPT), DOM)
    assert not res.hit
    assert e.cache.stats()[("disk", "tree")].misses.get("slower_than_prefill") == 1
    # the same files with a prefill ten times slower: taken
    fast = ReadCost(read_bytes_per_s=chain_bytes / 10, prefill_tokens_per_s=256 / 50)
    e = _restart(on_disk, layout, fast)
    res = e.cache.lookup(e.cache.keys(PROMPT), DOM)
    assert (res.hit, res.tier, res.tokens) == (True, "disk", 256)
    # a finished restore feeds the measured read bandwidth
    assert e.cache.begin_restore(res)
    e.cache.end_restore(res, True, 2.0)
    assert fast.reads_seen == 1
    assert fast.read_bytes_per_s == pytest.approx(res.plan.total_bytes / 2.0)


def test_what_ram_serves_is_not_counted_as_saved(on_disk, layout):
    """A chain only 64 tokens deeper than RAM's hit saves 64 tokens of prefill, not 256."""
    chain_bytes = sum(f.stat().st_size for f in on_disk.rglob("*.link"))
    cost = ReadCost(read_bytes_per_s=chain_bytes, prefill_tokens_per_s=100)  # 1 s read
    e = _restart(on_disk, layout, cost, ram_depth=0)
    assert e.cache.lookup(e.cache.keys(PROMPT), DOM).hit  # saves 2.56 s of prefill
    e = _restart(on_disk, layout, cost, ram_depth=192)
    assert not e.disk.lookup(e.cache.keys(PROMPT), DOM).hit  # saves 0.64 s only
    assert np.isclose(cost.prefill_seconds(64), 0.64)


def test_a_chain_ram_serves_as_deep_is_not_read_nor_counted_as_slower(on_disk, layout):
    """RAM's hit as deep as the disk chain (256 tokens): nothing to save, so no read, and no
    `slower_than_prefill` either (however fast the disk: no cost was weighed)."""
    cost = ReadCost(read_bytes_per_s=1e15, prefill_tokens_per_s=1.0)
    e = _restart(on_disk, layout, cost, ram_depth=256)
    assert not e.disk.lookup(e.cache.keys(PROMPT), DOM).hit
    assert "slower_than_prefill" not in e.cache.stats()[("disk", "tree")].misses
    e = _restart(on_disk, layout, cost, ram_depth=192)          # the control: 64 to save
    assert e.disk.lookup(e.cache.keys(PROMPT), DOM).hit
