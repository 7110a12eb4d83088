"""SlabArena: link buffers carved out of host slabs (pinned stores)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hybridcache.core import LinkStore, SlabArena, make_domain


def test_first_fit_reuse_and_coalescing():
    a = SlabArena(1024, pin_memory=False)
    b1, b2, b3 = a.alloc(100), a.alloc(200), a.alloc(300)
    assert (b1.offset, b2.offset, b3.offset) == (0, 128, 384)  # 64-byte aligned
    assert a.slabs == 1 and a.reserved_bytes == 1024 and a.used_bytes == 128 + 256 + 320
    a.free(b2)
    b4 = a.alloc(150)  # fits the hole left by b2
    assert b4.offset == 128
    a.free(b1)
    a.free(b4)
    a.free(b3)  # everything coalesces back to one free range
    assert a.used_bytes == 0 and a.slabs == 1  # one empty slab is kept
    big = a.alloc(700)
    assert big.offset == 0
    with pytest.raises(RuntimeError):
        a.free(b1)  # double free of a range now inside `big`


def test_large_blocks_are_dedicated_and_empty_slabs_released():
    a = SlabArena(1024, pin_memory=False, keep_free=1)
    d = a.alloc(5000)
    assert d.slab is None and a.reserved_bytes == 5000
    a.free(d)
    assert a.reserved_bytes == 0
    blocks = [a.alloc(512) for _ in range(6)]  # 3 slabs
    assert a.slabs == 3
    for b in blocks:
        a.free(b)
    assert a.slabs == 1 and a.used_bytes == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 1500)), min_size=1, max_size=60))
def test_blocks_never_overlap_and_keep_their_bytes(ops):
    a = SlabArena(2048, pin_memory=False)
    live: list[tuple[object, int]] = []
    for i, (alloc, size) in enumerate(ops):
        if alloc or not live:
            b = a.alloc(size)
            b.tensor.fill_(i % 251)
            live.append((b, i % 251))
        else:
            b, mark = live.pop(size % len(live))
            assert bool((b.tensor == mark).all())  # nobody wrote into it
            a.free(b)
        spans = sorted((id(b.slab), b.offset, b.offset + b.reserved) for b, _ in live
                       if b.slab is not None)
        for (s1, _, e1), (s2, o2, _) in itertools.pairwise(spans):
            assert s1 != s2 or e1 <= o2
        assert a.used_bytes == sum(b.reserved for b, _ in live)
    for b, mark in live:
        assert bool((b.tensor == mark).all())


def test_store_on_slabs_restores_and_frees(make_tree, layout):
    tree = make_tree()
    store = LinkStore(layout, pin_memory=False, slab_bytes=4096)
    d = make_domain(model="m")
    tokens = list(range(300))
    for p in (64, 128, 200):
        r = tree.reserve(tokens, p, d)
        bufs = store.allocate(r.link_id, r.end - r.start)
        for v in bufs.views.values():
            v.copy_(torch.arange(r.start, r.end).view(-1, *([1] * (v.dim() - 1))).expand_as(v))
        for t in bufs.sections.values():
            t.fill_(p)
        store.seal(r.link_id)
        tree.commit(r.link_id)
    assert store.bytes_reserved >= store.bytes_held
    plan = tree.lookup(tokens, d).plan
    dst = {v.name: torch.zeros(200, *v.row_shape, dtype=getattr(torch, v.dtype))
           for v in layout.views}
    store.restore_views_into(plan, dst)
    assert dst["kv"][:, 0, 0].tolist() == list(range(200))
    store.drop([plan.chain[1].link_id])
    r = tree.reserve(list(range(1000, 1300)), 100, d)  # reuses the freed range
    bufs = store.allocate(r.link_id, 100)
    for t in (*bufs.sections.values(), *bufs.views.values()):
        t.fill_(-1)
    for ref in (plan.chain[0], plan.chain[2]):  # neighbours untouched
        got = store.buffers(ref.link_id).views["kv"][:, 0, 0].tolist()
        assert got == list(range(ref.start, ref.end))
    assert store.clear() == 3 and store.bytes_reserved == 0


def test_default_slabs_only_when_pinned(layout):
    assert LinkStore(layout, pin_memory=False).bytes_reserved == 0
    s = LinkStore(layout, pin_memory=False, slab_bytes=1 << 16)
    s.allocate(1, 10)
    assert s.bytes_reserved == 1 << 16
