"""Property-based tests (hypothesis) over random insert/commit/abort/lookup/evict/clear runs.

Invariants checked after every step: the budget is never exceeded; parents outlive children;
the worker store holds exactly what the tree still references. Every lookup is compared with a
brute-force model: it must return exactly the deepest visible link whose tokens equal the
prompt's prefix in the same domain, and the restored rows (concatenated over the chain) must
equal the rows of the whole prefix. Run with a strong hash, a 1-byte hash and a hash where
every key collides.
"""

from __future__ import annotations

import hashlib

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from vllm_hybridcache.core import (
    LinkStore,
    SectionSpec,
    SnapshotTree,
    StateLayout,
    TreeConfig,
    ViewSpec,
    make_domain,
)

LAYOUT = StateLayout(
    sections=(SectionSpec("state", (2,), "float32"),),
    views=(ViewSpec("kv", (2,), "float32"), ViewSpec("idx", (1,), "float64")),
)
BUDGET = 4000
DOMAINS = (make_domain(t="a"), make_domain(t="b"))
# Prompts are concatenations of a few fixed segments, so they share prefixes a lot.
SEGMENTS = [
    [7] * 40,
    list(range(1, 70)),
    [3, 1, 4, 1, 5, 9, 2, 6] * 5,
    list(range(50, 10, -1)),
    [7] * 39 + [8],
]
prompts = st.lists(st.integers(0, len(SEGMENTS) - 1), min_size=1, max_size=6).map(
    lambda idx: tuple(t for i in idx for t in SEGMENTS[i])
)
fractions = st.floats(0.0, 1.0)


def row_value(token: int, pos: int, dom: int) -> float:
    return float(dom * 1_000_000 + token * 1000 + pos)


class TreeMachine(RuleBasedStateMachine):
    hasher = None

    @initialize(policy=st.sampled_from(["lru", "cost"]))
    def setup(self, policy: str) -> None:
        self.now = 0.0
        self.tree = SnapshotTree(
            LAYOUT,
            TreeConfig(budget_bytes=BUDGET, memory_floor_bytes=0, policy=policy,
                       cost_half_life_s=5.0),
            hasher=type(self).hasher,
            available_memory=lambda: 1 << 40,
            clock=lambda: self.now,
        )
        self.store = LinkStore(LAYOUT, pin_memory=False)
        # model: link id -> (domain index, tokens[:p], start, p, parent id)
        self.model: dict[int, tuple[int, tuple[int, ...], int, int, int | None]] = {}
        self.pending: list[int] = []
        self.active: list = []

    # ------------------------------------------------------------------ helpers
    def sync(self) -> None:
        self.now += 1.0
        self.store.drop(self.tree.drain_dropped())
        for lid in list(self.model):
            if not self.tree.has(lid):
                del self.model[lid]
        self.pending = [i for i in self.pending if self.tree.has(i)]

    def visible(self, lid: int) -> bool:
        while lid is not None:
            if not self.tree.is_committed(lid):
                return False
            lid = self.model[lid][4]
        return True

    # ------------------------------------------------------------------ rules
    @rule(prompt=prompts, frac=fractions, dom=st.integers(0, 1))
    def reserve(self, prompt, frac, dom) -> None:
        p = max(1, round(frac * len(prompt)))
        r = self.tree.reserve(list(prompt), p, DOMAINS[dom])
        if r.existing_id is not None:
            d, toks, _, ep, _ = self.model[r.existing_id]
            assert (d, toks, ep) == (dom, prompt[:p], p)
        if r.link_id is not None:
            assert r.end == p and r.start < p
            if r.parent_id is not None:
                pd, ptoks, _, pp, _ = self.model[r.parent_id]
                assert pd == dom and pp == r.start and ptoks == prompt[:pp]
            else:
                assert r.start == 0
            self.model[r.link_id] = (dom, prompt[:p], r.start, p, r.parent_id)
            bufs = self.store.allocate(r.link_id, p - r.start)
            bufs.sections["state"].fill_(float(p + dom * 100_000))
            vals = torch.tensor(
                [row_value(prompt[i], i, dom) for i in range(r.start, p)], dtype=torch.float64
            )
            bufs.views["kv"].copy_(vals.view(-1, 1).expand(-1, 2))
            bufs.views["idx"].copy_(vals.view(-1, 1))
            self.pending.append(r.link_id)
        self.sync()

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def commit(self, data) -> None:
        lid = data.draw(st.sampled_from(self.pending))
        assert self.tree.commit(lid)
        self.store.seal(lid)
        self.pending.remove(lid)
        self.sync()

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort(self, data) -> None:
        lid = data.draw(st.sampled_from(self.pending))
        assert self.tree.abort(lid) >= 1
        assert not self.tree.has(lid)
        self.sync()

    @rule(prompt=prompts, frac=fractions, dom=st.integers(0, 1), pin=st.booleans())
    def lookup(self, prompt, frac, dom, pin) -> None:
        limit = round(frac * len(prompt))
        res = self.tree.lookup(list(prompt), DOMAINS[dom], limit)
        best = 0
        for lid, (d, toks, _, p, _) in self.model.items():
            if d == dom and p <= limit and toks == prompt[:p] and self.visible(lid):
                best = max(best, p)
        assert res.tokens == best, (res, best)
        assert res.hit == (best > 0)
        if not res.hit:
            assert res.miss_reason is not None
            self.tree.record_lookup(res)
            return
        plan = res.plan
        pos = 0
        for ref in plan.chain:
            d, toks, start, p, _ = self.model[ref.link_id]
            assert d == dom and toks == prompt[:p] and (start, p) == (ref.start, ref.end)
            assert ref.start == pos
            pos = ref.end
        assert pos == res.tokens
        dst = {v.name: torch.zeros(res.tokens, *v.row_shape, dtype=getattr(torch, v.dtype))
               for v in LAYOUT.views}
        sec = {"state": torch.zeros(2)}
        self.store.restore(plan, sec, lambda n, s, rows: dst[n][s : s + rows.shape[0]].copy_(rows))
        want = torch.tensor([row_value(prompt[i], i, dom) for i in range(res.tokens)],
                            dtype=torch.float64)
        assert torch.equal(dst["idx"][:, 0], want)
        assert torch.equal(dst["kv"].double(), want.view(-1, 1).expand(-1, 2))
        assert bool((sec["state"] == res.tokens + dom * 100_000).all())
        into = {v.name: torch.full((res.tokens, *v.row_shape), -1.0, dtype=getattr(torch, v.dtype))
                for v in LAYOUT.views}
        self.store.restore_views_into(plan, into)
        assert all(torch.equal(into[k], dst[k]) for k in into)
        assert self.tree.begin_restore(res)
        if pin:
            self.active.append(res)
        else:
            self.tree.end_restore(res.plan, ok=True)
        self.sync()

    @precondition(lambda self: self.active)
    @rule(data=st.data(), ok=st.booleans())
    def end_restore(self, data, ok) -> None:
        res = data.draw(st.sampled_from(self.active))
        self.active.remove(res)
        self.tree.end_restore(res.plan, ok=ok)
        self.sync()

    @rule(nbytes=st.integers(0, BUDGET))
    def evict(self, nbytes) -> None:
        self.tree.evict(nbytes)
        self.sync()

    @rule()
    def clear(self) -> None:
        self.tree.clear()
        assert len(self.tree) == 0 and self.tree.bytes_held == 0
        self.pending.clear()
        self.sync()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def budget_never_exceeded(self) -> None:
        assert self.tree.bytes_held <= BUDGET
        assert self.tree.bytes_held == sum(
            LAYOUT.link_bytes(p - s) for _, _, s, p, _ in self.model.values()
        )

    @invariant()
    def parents_outlive_children(self) -> None:
        for lid in self.tree.link_ids():
            parent = self.tree.parent_of(lid)
            assert parent is None or self.tree.has(parent)
            assert parent == self.model[lid][4]

    @invariant()
    def store_matches_tree(self) -> None:
        for lid in self.tree.link_ids():
            assert self.store.has(lid) == self.tree.is_committed(lid)
        pinned = {ref.link_id for res in self.active for ref in res.plan.chain}
        for lid in list(self.store._entries):
            assert self.tree.has(lid) or lid in pinned

    def teardown(self) -> None:
        for res in self.active:
            self.tree.end_restore(res.plan, ok=True)
        self.store.drop(self.tree.drain_dropped())
        self.tree.clear()
        self.store.drop(self.tree.drain_dropped())
        assert len(self.store) == 0


SETTINGS = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class StrongHash(TreeMachine):
    hasher = None


class OneByteHash(TreeMachine):
    hasher = staticmethod(lambda data: hashlib.blake2b(data, digest_size=1).digest())


class AlwaysCollides(TreeMachine):
    hasher = staticmethod(lambda data: b"\x00")


TestStrongHash = StrongHash.TestCase
TestStrongHash.settings = SETTINGS
TestOneByteHash = OneByteHash.TestCase
TestOneByteHash.settings = SETTINGS
TestAlwaysCollides = AlwaysCollides.TestCase
TestAlwaysCollides.settings = SETTINGS
