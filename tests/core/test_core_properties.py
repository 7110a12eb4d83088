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


BLOCK_LAYOUT = StateLayout(
    sections=(SectionSpec("state", (2,), "float32"),),
    views=(ViewSpec("kv", (4,), "float64"),),
    view_block_tokens=4,
)


class TreeMachine(RuleBasedStateMachine):
    """Token-granular views (one row per token)."""

    hasher = None
    layout = LAYOUT
    slab_bytes = 0  # 0: one allocation per link; > 0: links carved out of slabs (ranges reused)

    @initialize(policy=st.sampled_from(["lru", "cost"]))
    def setup(self, policy: str) -> None:
        self.now = 0.0
        self.tree = SnapshotTree(
            self.layout,
            TreeConfig(budget_bytes=BUDGET, memory_floor_bytes=0, policy=policy,
                       cost_half_life_s=5.0),
            hasher=type(self).hasher,
            available_memory=lambda: 1 << 40,
            clock=lambda: self.now,
        )
        self.store = LinkStore(self.layout, pin_memory=False, slab_bytes=self.slab_bytes)
        # model: link id -> (domain index, tokens[:p], start, p, parent id)
        self.model: dict[int, tuple[int, tuple[int, ...], int, int, int | None]] = {}
        self.pending: list[int] = []
        self.active: list = []
        self.seen: list[tuple[tuple[int, ...], int]] = []  # (prompt, domain) reserved before

    # ------------------------------------------------------------------ helpers
    def sync(self) -> None:
        self.now += 1.0
        self.store.drop(self.tree.drain_dropped())
        for lid in list(self.model):
            if not self.tree.has(lid):
                del self.model[lid]
        self.pending = [i for i in self.pending if self.tree.has(i)]

    def fill_views(self, views, prompt, start: int, p: int, dom: int) -> None:
        vals = torch.tensor(
            [row_value(prompt[i], i, dom) for i in range(start, p)], dtype=torch.float64
        )
        views["kv"].copy_(vals.view(-1, 1).expand(-1, 2))
        views["idx"].copy_(vals.view(-1, 1))

    def check_views(self, plan, prompt, n: int, dom: int) -> None:
        """Restore through both paths; the rows must be those of the whole prefix."""
        dst = {v.name: torch.zeros(n, *v.row_shape, dtype=getattr(torch, v.dtype))
               for v in LAYOUT.views}
        sec = {"state": torch.zeros(2)}
        self.store.restore(plan, sec, lambda k, s, rows: dst[k][s : s + rows.shape[0]].copy_(rows))
        assert bool((sec["state"] == n + dom * 100_000).all())
        want = torch.tensor([row_value(prompt[i], i, dom) for i in range(n)],
                            dtype=torch.float64)
        assert torch.equal(dst["idx"][:, 0], want)
        assert torch.equal(dst["kv"].double(), want.view(-1, 1).expand(-1, 2))
        into = {v.name: torch.full((n, *v.row_shape), -1.0, dtype=getattr(torch, v.dtype))
                for v in LAYOUT.views}
        self.store.restore_views_into(plan, into)
        assert all(torch.equal(into[k], dst[k]) for k in into)

    def visible(self, lid: int) -> bool:
        while lid is not None:
            if not self.tree.is_committed(lid):
                return False
            lid = self.model[lid][4]
        return True

    # ------------------------------------------------------------------ rules
    @rule(prompt=prompts, frac=fractions, dom=st.integers(0, 1), now=st.booleans())
    def reserve(self, prompt, frac, dom, now) -> None:
        self._reserve(prompt, frac, dom, now)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), frac=fractions, now=st.booleans())
    def reserve_again(self, data, frac, now) -> None:
        """Capture another cut of a prompt seen before: chains grow as in a real prefill."""
        prompt, dom = data.draw(st.sampled_from(self.seen))
        self._reserve(prompt, frac, dom, now)

    def _reserve(self, prompt, frac, dom, commit_now) -> None:
        """Reserve a cut and fill its buffers; with commit_now, seal and commit at once (the
        step succeeded before anything else happened)."""
        if (prompt, dom) not in self.seen:
            self.seen.append((prompt, dom))
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
            bufs = self.store.allocate(r.link_id, self.layout.view_rows(r.start, p))
            bufs.sections["state"].fill_(float(p + dom * 100_000))
            self.fill_views(bufs.views, prompt, r.start, p, dom)
            if commit_now:
                assert self.tree.commit(r.link_id)
                self.store.seal(r.link_id)
            else:
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
        self._lookup(prompt, frac, dom, pin)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), frac=fractions, other_domain=st.booleans(), pin=st.booleans())
    def lookup_again(self, data, frac, other_domain, pin) -> None:
        """Look up a prompt seen before (in its own domain, or in the other one)."""
        prompt, dom = data.draw(st.sampled_from(self.seen))
        self._lookup(prompt, frac, 1 - dom if other_domain else dom, pin)

    def _lookup(self, prompt, frac, dom, pin) -> None:
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
        self.check_views(plan, prompt, res.tokens, dom)
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
        lay = self.layout
        assert self.tree.bytes_held == sum(
            lay.link_bytes(lay.view_rows(s, p)) for _, _, s, p, _ in self.model.values()
        )

    @invariant()
    def tree_recounts_clean(self) -> None:
        self.tree.sanity_check()

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


class BlockRows(TreeMachine):
    """Block-granular views (view_block_tokens = 4): a link stores every block overlapping its
    range, slots past its cut hold garbage (-1), and the later link's copy of a shared boundary
    block must win on restore."""

    layout = BLOCK_LAYOUT

    def fill_views(self, views, prompt, start: int, p: int, dom: int) -> None:
        b = self.layout.view_block_tokens
        first = start // b
        kv = views["kv"]
        for r in range(kv.shape[0]):
            for slot in range(b):
                pos = (first + r) * b + slot
                kv[r, slot] = row_value(prompt[pos], pos, dom) if pos < p else -1.0

    def check_views(self, plan, prompt, n: int, dom: int) -> None:
        b = self.layout.view_block_tokens
        blocks = -(-n // b)
        dst = torch.full((blocks, b), -2.0, dtype=torch.float64)
        sec = {"state": torch.zeros(2)}
        self.store.restore(plan, sec, lambda k, s, rows: dst[s : s + rows.shape[0]].copy_(rows))
        assert bool((sec["state"] == n + dom * 100_000).all())
        want = torch.tensor([row_value(prompt[i], i, dom) for i in range(n)],
                            dtype=torch.float64)
        assert torch.equal(dst.view(-1)[:n], want)
        into = {"kv": torch.full((blocks, b), -2.0, dtype=torch.float64)}
        self.store.restore_views_into(plan, into)
        assert torch.equal(into["kv"].view(-1)[:n], want)


class StrongHash(TreeMachine):
    hasher = None


class OneByteHash(TreeMachine):
    hasher = staticmethod(lambda data: hashlib.blake2b(data, digest_size=1).digest())
    slab_bytes = 4096


class AlwaysCollides(TreeMachine):
    hasher = staticmethod(lambda data: b"\x00")


TestStrongHash = StrongHash.TestCase
TestStrongHash.settings = SETTINGS
TestOneByteHash = OneByteHash.TestCase
TestOneByteHash.settings = SETTINGS
TestAlwaysCollides = AlwaysCollides.TestCase
TestAlwaysCollides.settings = SETTINGS
TestBlockRows = BlockRows.TestCase
TestBlockRows.settings = SETTINGS
