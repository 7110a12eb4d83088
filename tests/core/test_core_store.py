"""LinkStore: the worker-side payload store (reqs. 1 and 3)."""

from __future__ import annotations

import pytest
import torch

from vllm_hybridcache.core import LinkStore, MissingLinkError, make_domain

D = make_domain(model="m")


def fill(store, res, tokens):
    """Fill a reserved link: sections = its cut, views = f(token, position)."""
    rows = res.end - res.start
    bufs = store.allocate(res.link_id, rows)
    for t in bufs.sections.values():
        t.fill_(res.end)
    pos = torch.arange(res.start, res.end, dtype=torch.float32)
    tok = torch.tensor(tokens[res.start : res.end], dtype=torch.float32)
    for v in bufs.views.values():
        v.copy_((tok * 1000 + pos).view(rows, *([1] * (v.dim() - 1))).expand_as(v))
    store.seal(res.link_id)
    return bufs


def expected_rows(tokens, n, view):
    val = torch.tensor(tokens[:n], dtype=torch.float32) * 1000 + torch.arange(n)
    return val.view(n, *([1] * len(view.row_shape))).expand(n, *view.row_shape)


def test_allocate_gives_typed_host_tensors(layout):
    store = LinkStore(layout, pin_memory=False)
    bufs = store.allocate(7, rows=5)
    assert bufs.sections["gdn"].shape == (2, 4) and bufs.sections["gdn"].dtype == torch.float32
    assert bufs.sections["conv"].dtype == torch.bfloat16
    assert bufs.views["kv"].shape == (5, 2, 2) and bufs.views["idx"].shape == (5, 1)
    assert bufs.views["kv"].device.type == "cpu"
    assert store.bytes_held >= layout.link_bytes(5)
    assert store.bytes_held - layout.link_bytes(5) == store.padding_bytes(5) < 64 * 4
    # parts do not overlap
    for t in (*bufs.sections.values(), *bufs.views.values()):
        t.fill_(0)
    bufs.sections["gdn"].fill_(1)
    assert bufs.views["kv"].abs().sum() == 0 and bufs.sections["conv"].abs().sum() == 0
    with pytest.raises(ValueError):
        store.allocate(7, rows=1)
    assert not store.has(7)  # allocated, not sealed


def test_pin_memory_defaults_to_device_presence(layout):
    assert LinkStore(layout).pin_memory == torch.cuda.is_available()


def test_restore_chain_concatenates_rows(make_tree, layout):
    tree, store = make_tree(), LinkStore(layout, pin_memory=False)
    tokens = list(range(500, 800))
    for p in (64, 128, 200):
        fill(store, tree.reserve(tokens, p, D), tokens)
        tree.commit(tree.link_ids()[-1])
    res = tree.lookup(tokens, D, 299)
    got: dict[str, list[tuple[int, torch.Tensor]]] = {}
    sec = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in layout.sections}
    moved = store.restore(res.plan, sec, lambda n, start, rows: got.setdefault(n, []).append(
        (start, rows)))
    assert moved == res.plan.total_bytes
    assert all(bool((t == 200).all()) for t in sec.values())
    for v in layout.views:
        starts = [s for s, _ in got[v.name]]
        assert starts == [0, 64, 128]
        cat = torch.cat([r for _, r in got[v.name]])
        assert torch.equal(cat, expected_rows(tokens, 200, v).to(cat.dtype))
    dst = {v.name: torch.zeros(200, *v.row_shape, dtype=getattr(torch, v.dtype))
           for v in layout.views}
    assert store.restore_views_into(res.plan, dst) == res.plan.total_bytes - layout.section_bytes
    for v in layout.views:
        assert torch.equal(dst[v.name], expected_rows(tokens, 200, v).to(dst[v.name].dtype))


def test_view_sink_gets_views_not_copies(make_tree, layout):
    tree, store = make_tree(), LinkStore(layout, pin_memory=False)
    tokens = list(range(100))
    r = tree.reserve(tokens, 64, D)
    bufs = fill(store, r, tokens)
    tree.commit(r.link_id)
    res = tree.lookup(tokens, D)
    seen = []
    store.restore(res.plan, {s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype))
                             for s in layout.sections},
                  lambda n, s, rows: seen.append(rows.data_ptr()))
    assert seen == [bufs.views["kv"].data_ptr(), bufs.views["idx"].data_ptr()]


def test_missing_link_raises_and_leaves_destination_untouched(make_tree, layout):
    tree, store = make_tree(), LinkStore(layout, pin_memory=False)
    tokens = list(range(300))
    for p in (64, 128):
        fill(store, tree.reserve(tokens, p, D), tokens)
    for lid in tree.link_ids():
        tree.commit(lid)
    res = tree.lookup(tokens, D)
    store.drop([res.plan.chain[0].link_id])
    sec = {s.name: torch.full(s.shape, -1.0).to(getattr(torch, s.dtype)) for s in layout.sections}
    calls = []
    with pytest.raises(MissingLinkError):
        store.restore(res.plan, sec, lambda *a: calls.append(a))
    assert calls == [] and all(bool((t == -1).all()) for t in sec.values())
    with pytest.raises(MissingLinkError):
        store.restore_views_into(res.plan, {})


def test_row_mismatch_names_the_link_at_fault(make_tree, layout):
    """Defect 7a: a link holding other rows than the plan wants must be named (link_id), so
    the worker reports it lost and the scheduler stops offering it; the error used to carry
    only a message."""
    tree, store = make_tree(), LinkStore(layout, pin_memory=False)
    tokens = list(range(100))
    r = tree.reserve(tokens, 64, D)
    store.allocate(r.link_id, 10)  # not the 64 rows the plan will want
    store.seal(r.link_id)
    tree.commit(r.link_id)
    plan = tree.lookup(tokens, D).plan
    with pytest.raises(MissingLinkError) as e:
        store.restore(plan, {}, lambda *a: None)
    assert e.value.link_id == r.link_id and "holds 10 rows" in str(e.value)
    with pytest.raises(MissingLinkError) as e:
        store.restore_views_into(plan.chain, {})  # a bare chain, as the worker receives it
    assert e.value.link_id == r.link_id
    store.drop([r.link_id])
    with pytest.raises(MissingLinkError) as e:
        store.restore(plan.chain, {}, lambda *a: None)
    assert e.value.link_id == r.link_id and MissingLinkError(None, "x").link_id is None


def test_unsealed_link_is_not_restorable(make_tree, layout):
    tree, store = make_tree(), LinkStore(layout, pin_memory=False)
    tokens = list(range(100))
    r = tree.reserve(tokens, 64, D)
    store.allocate(r.link_id, 64)
    tree.commit(r.link_id)
    with pytest.raises(MissingLinkError):
        store.restore_views_into(tree.lookup(tokens, D).plan, {})
    store.discard(r.link_id)
    assert len(store) == 0 and store.bytes_held == 0


def test_drop_and_clear_free_bytes(layout):
    store = LinkStore(layout, pin_memory=False)
    for i in range(4):
        store.allocate(i, rows=10)
        store.seal(i)
    per = store.bytes_held // 4
    assert store.drop([0, 1, 99]) == 2 * per
    assert store.bytes_held == 2 * per and store.has(2) and not store.has(0)
    assert store.clear() == 2 and store.bytes_held == 0


def test_zero_row_link_restores_sections(make_tree, layout):
    store = LinkStore(layout, pin_memory=False)
    bufs = store.allocate(1, rows=0)
    bufs.sections["gdn"].fill_(3)
    store.seal(1)
    from vllm_hybridcache.core import LinkRef, RestorePlan

    plan = RestorePlan((LinkRef(1, 64, 64),), 64, {}, layout.section_bytes)
    sec = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in layout.sections}
    store.restore(plan, sec, lambda *a: pytest.fail("no rows to hand over"))
    assert bool((sec["gdn"] == 3).all())


def test_block_granular_views_restore_in_chain_order(make_tree, layout):
    """view_block_tokens = B: a link stores every block overlapping its token range; the later
    link's copy of a shared boundary block is restored after (and over) the earlier one."""
    import msgspec

    from vllm_hybridcache.core import SnapshotTree, TreeConfig

    blayout = msgspec.structs.replace(layout, view_block_tokens=16)
    assert blayout.view_rows(0, 100) == 7 and blayout.view_rows(100, 200) == 7
    assert blayout.view_rows(96, 112) == 1 and blayout.view_rows(5, 5) == 0
    tree = SnapshotTree(blayout, TreeConfig(budget_bytes=1 << 20, memory_floor_bytes=0))
    store = LinkStore(blayout, pin_memory=False)
    tokens = list(range(300))
    for p, mark in ((100, 1.0), (200, 2.0)):
        r = tree.reserve(tokens, p, D)
        assert r.nbytes == blayout.link_bytes(blayout.view_rows(r.start, p))
        bufs = store.allocate(r.link_id, blayout.view_rows(r.start, p))
        for v in bufs.views.values():
            v.fill_(mark)
        for t in bufs.sections.values():
            t.fill_(p)
        store.seal(r.link_id)
        tree.commit(r.link_id)
    plan = tree.lookup(tokens, D).plan
    assert plan.part_bytes["kv"] == 8 * 14 and plan.total_bytes == sum(plan.part_bytes.values())
    dst = {v.name: torch.zeros(13, *v.row_shape, dtype=getattr(torch, v.dtype))
           for v in blayout.views}
    assert store.restore_views_into(plan, dst) == plan.total_bytes - blayout.section_bytes
    kv = dst["kv"][:, 0, 0].tolist()
    assert kv == [1.0] * 6 + [2.0] * 7  # block 6 is shared: the later link's copy wins
    calls = []
    store.restore(plan, {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype))
                         for s in blayout.sections},
                  lambda n, start, rows: calls.append((n, start, rows.shape[0])))
    assert calls == [("kv", 0, 7), ("idx", 0, 7), ("kv", 6, 7), ("idx", 6, 7)]


def test_restore_views_into_non_contiguous_destination(make_tree, layout):
    tree, store = make_tree(), LinkStore(layout, pin_memory=False)
    tokens = list(range(40, 240))
    for p in (64, 150):
        fill(store, tree.reserve(tokens, p, D), tokens)
        tree.commit(tree.link_ids()[-1])
    plan = tree.lookup(tokens, D).plan
    # every other row of a larger tensor: not contiguous, takes the typed path
    big = {v.name: torch.zeros(2 * 150, *v.row_shape, dtype=getattr(torch, v.dtype))
           for v in layout.views}
    dst = {k: t[::2] for k, t in big.items()}
    assert not dst["kv"].is_contiguous()
    store.restore_views_into(plan, dst)
    for v in layout.views:
        assert torch.equal(dst[v.name], expected_rows(tokens, 150, v).to(dst[v.name].dtype))
        assert big[v.name][1::2].abs().sum() == 0
