"""Microbenchmarks of the cache core (vllm_hybridcache.core); no vLLM, no model, CPU only.

    python -m benchmarks.core_bench            # full run (< 2 minutes), markdown on stdout
    python -m benchmarks.core_bench --quick    # smaller sizes, for a smoke check

Sections of the report:
1. lookup and insert latency with 10^4 links and prompts up to 256K tokens;
2. restore assembly throughput, as a ratio to a plain torch copy of the same bytes (same run);
3. bookkeeping memory per link beyond its payload;
4. eviction policies (LRU vs recompute-cost) on agent-like access patterns at equal budgets.
The results are committed as docs/benchmarks/core.md.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import psutil
import torch

from vllm_hybridcache.core import (
    LinkStore,
    SectionSpec,
    SnapshotTree,
    StateLayout,
    TreeConfig,
    ViewSpec,
    make_domain,
)

GRID = 512  # segmentation grid G (tokens)
MSG_MIN = 128  # a message end is a cut when at least this far after the previous cut
BIG = 1 << 50  # "unlimited" budget for the latency runs (the tree holds no payload)
DOMAIN = make_domain(bench="core")

# A mid-size hybrid model as the engine would describe it: 27 GDN layers (fp32 recurrent state
# 16 x 128 x 128 plus a bf16 conv tail) and 9 attention layers (bf16 K/V, 2 KV heads x 256,
# plus 128-dim index keys). Only used for sizes; the tree never allocates payload.
REF_LAYOUT = StateLayout(
    sections=tuple(SectionSpec(f"gdn{i}.state", (16, 128, 128), "float32") for i in range(27))
    + tuple(SectionSpec(f"gdn{i}.conv", (3, 6144), "bfloat16") for i in range(27)),
    views=tuple(ViewSpec(f"attn{i}.kv", (2, 2, 256), "bfloat16") for i in range(9))
    + tuple(ViewSpec(f"attn{i}.idx", (128,), "bfloat16") for i in range(9)),
)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs" if seconds < 1e-2 else f"{seconds * 1e3:,.2f} ms"


def cuts_of(length: int, message_ends: Sequence[int] = ()) -> list[int]:
    """Segmentation: every multiple of GRID, and message ends >= MSG_MIN after the last cut."""
    ends = sorted(set(message_ends))
    out: list[int] = []
    last = 0
    j = 0
    for g in range(GRID, length + 1, GRID):
        while j < len(ends) and ends[j] < g:
            if ends[j] - last >= MSG_MIN:
                out.append(ends[j])
                last = ends[j]
            j += 1
        out.append(g)
        last = g
    while j < len(ends) and ends[j] <= length:
        if ends[j] - last >= MSG_MIN:
            out.append(ends[j])
            last = ends[j]
        j += 1
    return out


def _timeit(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(best, median) seconds of `reps` calls. The machine is shared: other jobs only ever add
    time, so the best run estimates the operation's own cost and the median shows the noise."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def _pair(t: tuple[float, float]) -> str:
    return f"{_us(t[0])} | {_us(t[1])}"


# ---------------------------------------------------------------------------------- 1. latency
def bench_latency(quick: bool) -> list[str]:
    rng = np.random.default_rng(1)
    long_len = 65_536 if quick else 262_144
    deep_sessions = 2 if quick else 4
    head = rng.integers(0, 150_000, 8192)
    tree = SnapshotTree(REF_LAYOUT, TreeConfig(budget_bytes=BIG, memory_floor_bytes=0))
    insert_times: list[float] = []
    deepest_insert: list[float] = []

    def capture(tokens: np.ndarray, cuts: list[int]) -> None:
        keys = tree.keys(tokens)
        for c in cuts:
            t0 = time.perf_counter()
            r = tree.reserve(keys, c, DOMAIN)
            if r.link_id is not None:
                tree.commit(r.link_id)
            dt = time.perf_counter() - t0
            insert_times.append(dt)
            if c == cuts[-1] and len(tokens) >= long_len:
                deepest_insert.append(dt)

    long_prompts = []
    for _ in range(deep_sessions):
        toks = np.concatenate([head, rng.integers(0, 150_000, long_len - len(head))])
        long_prompts.append(toks)
        capture(toks, cuts_of(len(toks)))
    target = 1_000 if quick else 10_000
    short = 0
    while len(tree) < target:
        toks = np.concatenate([head[: 1024 * (1 + short % 4)],
                               rng.integers(0, 150_000, 3072)])
        ends = sorted(rng.integers(200, len(toks), 4).tolist())
        capture(toks, cuts_of(len(toks), ends))
        short += 1
    n_links = len(tree)

    probe = long_prompts[0]
    probe_list = probe.tolist()
    limit = len(probe) - 1
    keys = tree.keys(probe)
    res = tree.lookup(keys, DOMAIN, limit)
    assert res.hit
    reps = 3 if quick else 5
    t_hit_keys = _timeit(lambda: tree.lookup(keys, DOMAIN, limit), reps)
    t_hit_list = _timeit(lambda: tree.lookup(probe_list, DOMAIN, limit), reps)
    t_keys = _timeit(lambda: tree.keys(probe_list).digest(limit), reps)
    diverge = probe.copy()
    diverge[len(probe) // 2 + 100] += 1
    t_half = _timeit(lambda: tree.lookup(diverge, DOMAIN, limit), reps)
    miss = rng.integers(0, 150_000, len(probe))
    t_miss = _timeit(lambda: tree.lookup(miss, DOMAIN, limit), reps)
    short_probe = np.concatenate([head[:2048], rng.integers(0, 150_000, 2048)])
    t_short = _timeit(lambda: tree.lookup(short_probe, DOMAIN), 50)
    # reserve at the end of a long prompt: a fresh key at the deepest position, repeated with
    # reserve + abort (the abort leaves a refusal mark only at that cut, which the next
    # reservation of the same cut clears)
    ext = np.concatenate([probe, rng.integers(0, 150_000, GRID)])
    ext_keys = tree.keys(ext)
    ext_keys.digest(len(ext))
    res_times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = tree.reserve(ext_keys, len(ext), DOMAIN)
        res_times.append(time.perf_counter() - t0)
        assert r.link_id is not None
        tree.abort(r.link_id)
    t_res_deep = (min(res_times), statistics.median(res_times))

    lines = [
        "## 1. Lookup and insert latency",
        "",
        f"Tree: {n_links:,} links ({deep_sessions} sessions of {long_len:,} tokens sharing an "
        f"8K head, cut every {GRID} tokens = {res.plan and len(res.plan.chain)} links deep, "
        f"plus {short:,} short sessions with message-end cuts). Best and median of repeated "
        "calls.",
        "",
        "| operation | best | median |",
        "|---|---|---|",
        f"| lookup, {long_len // 1024}K-token hit ({len(res.plan.chain)}-link chain), prompt "
        f"as PromptKeys reused (digests cached) | {_pair(t_hit_keys)} |",
        f"| lookup, same hit, prompt as a Python list (array conversion + hashing included) "
        f"| {_pair(t_hit_list)} |",
        f"| of which: hashing a {long_len // 1024}K-token prompt (tree.keys + digest) "
        f"| {_pair(t_keys)} |",
        f"| lookup, {long_len // 1024}K prompt diverging at the middle (hit at half depth, "
        f"fresh array) | {_pair(t_half)} |",
        f"| lookup, {long_len // 1024}K prompt, no shared prefix (miss, fresh array) "
        f"| {_pair(t_miss)} |",
        f"| lookup, 4K prompt (hit on the shared head, fresh array) | {_pair(t_short)} |",
        f"| insert (reserve + commit), over all {len(insert_times):,} inserts of the build "
        f"(PromptKeys per request) | {_us(min(insert_times))} "
        f"| {_us(statistics.median(insert_times))} (mean {_us(statistics.fmean(insert_times))}) |",
        f"| insert at the deepest cut of a {long_len // 1024}K prompt "
        f"| {_us(min(deepest_insert))} | {_us(statistics.median(deepest_insert))} |",
        f"| reserve of a new cut at depth {len(ext):,} (PromptKeys reused) "
        f"| {_pair(t_res_deep)} |",
        "",
        "The walk verifies every link of the chain token by token (a bytes comparison of the "
        "link's own tokens), so a hit costs O(depth) plus one digest per candidate cut; the "
        "digests are memoised in the request's PromptKeys, which the adapter keeps per "
        "request.",
        "",
    ]
    return lines


# ---------------------------------------------------------------------------------- 2. restore
def bench_restore(quick: bool) -> list[str]:
    # A scaled-down reference layout (4 GDN layers, 3 attention layers) so the run fits in RAM
    # next to the other engineers' jobs; the copy pattern (sections whole, view rows per link)
    # is the same as for the full model.
    layout = StateLayout(
        sections=tuple(SectionSpec(f"gdn{i}.state", (16, 128, 128), "float32") for i in range(4))
        + tuple(SectionSpec(f"gdn{i}.conv", (3, 6144), "bfloat16") for i in range(4)),
        views=tuple(ViewSpec(f"attn{i}.kv", (2, 2, 256), "bfloat16") for i in range(3))
        + tuple(ViewSpec(f"attn{i}.idx", (128,), "bfloat16") for i in range(3)),
    )
    n_links = 16 if quick else 48
    tokens = list(range(n_links * GRID + 1))
    tree = SnapshotTree(layout, TreeConfig(budget_bytes=BIG, memory_floor_bytes=0))
    store = LinkStore(layout, pin_memory=False)
    keys = tree.keys(tokens)
    for c in range(GRID, n_links * GRID + 1, GRID):
        r = tree.reserve(keys, c, DOMAIN)
        bufs = store.allocate(r.link_id, r.end - r.start)
        for t in (*bufs.sections.values(), *bufs.views.values()):
            t.view(-1).view(torch.uint8).random_(0, 255)
        store.seal(r.link_id)
        tree.commit(r.link_id)
    res = tree.lookup(keys, DOMAIN, len(tokens) - 1)
    plan = res.plan
    assert plan is not None and len(plan.chain) == n_links
    sec_dst = {s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype))
               for s in layout.sections}
    view_dst = {v.name: torch.empty(plan.tokens, *v.row_shape, dtype=getattr(torch, v.dtype))
                for v in layout.views}
    total = plan.total_bytes
    src_plain = torch.empty(total, dtype=torch.uint8).random_(0, 255)
    dst_plain = torch.empty(total, dtype=torch.uint8)

    def restore() -> None:
        for name, dst in sec_dst.items():
            dst.copy_(store.buffers(plan.deepest).sections[name])
        store.restore_views_into(plan, view_dst)

    def restore_sink() -> None:
        # the adapter's path: sections copied, rows handed over as views and scattered into
        # paged blocks of 16 rows (here: copied into the contiguous destination per link)
        store.restore(plan, sec_dst, lambda n, s, rows: view_dst[n][s : s + len(rows)].copy_(
            rows))

    def plain() -> None:
        dst_plain.copy_(src_plain)

    # the same bytes in the same chunks as the restore, but from one buffer into one buffer:
    # separates the cost of chunking (memory system) from the cost of the assembly code
    chunks = [s.nbytes for s in layout.sections] + [
        v.bytes_per_row * (ref.end - ref.start) for ref in plan.chain for v in layout.views
    ]
    bounds = np.cumsum([0, *chunks]).tolist()

    def plain_chunked() -> None:
        for a, b in itertools.pairwise(bounds):
            dst_plain[a:b].copy_(src_plain[a:b])

    for fn in (restore, restore_sink, plain, plain_chunked):  # warm up (first-touch faults)
        fn()
    reps = 9 if quick else 25
    t_restore, t_sink, t_plain, t_chunk = [], [], [], []
    for _ in range(reps):  # interleaved so that noise from other jobs hits all alike
        t_plain.append(_timeit(plain, 1)[0])
        t_restore.append(_timeit(restore, 1)[0])
        t_sink.append(_timeit(restore_sink, 1)[0])
        t_chunk.append(_timeit(plain_chunked, 1)[0])
    # The machine is shared: other jobs only ever add time, so the best of N runs is the
    # estimate of each path's own cost; medians are shown as well.
    mp, mr, ms, mc = (min(x) for x in (t_plain, t_restore, t_sink, t_chunk))
    # paired ratios: each round's plain copy against the same round's restore, so that a busy
    # period slows both sides of a ratio alike
    pr, ps, pc = (
        statistics.median(a / b for a, b in zip(t_plain, x, strict=True))
        for x in (t_restore, t_sink, t_chunk)
    )
    # correctness of what was timed
    ref = store.buffers(plan.chain[3].link_id).views[layout.views[0].name]
    got = view_dst[layout.views[0].name][3 * GRID : 4 * GRID]
    assert torch.equal(got.reshape(-1).view(torch.int16), ref.reshape(-1).view(torch.int16))
    gbs = lambda t: total / t / 1e9  # noqa: E731
    lines = [
        "## 2. Restore assembly throughput",
        "",
        f"Chain of {n_links} links x {GRID} rows = {plan.tokens:,} tokens, "
        f"{len(layout.sections)} sections ({_fmt_bytes(layout.section_bytes)}) + "
        f"{len(layout.views)} views ({_fmt_bytes(layout.view_bytes_per_row)}/row): "
        f"{_fmt_bytes(total)} per restore, host to host (CPU), unpinned. {reps} rounds; each "
        "round runs the four paths back to back. Ratios are throughput relative to the plain "
        "copy (higher is better).",
        "",
        "| path | best time | best throughput | ratio of best times | median of paired "
        "ratios |",
        "|---|---|---|---|---|",
        f"| plain `torch.Tensor.copy_` of {_fmt_bytes(total)} (one contiguous tensor) "
        f"| {_us(mp)} | {gbs(mp):.2f} GB/s | 1.00 | 1.00 |",
        f"| `LinkStore.restore_views_into` + sections | {_us(mr)} | {gbs(mr):.2f} GB/s "
        f"| **{mp / mr:.2f}** | **{pr:.2f}** |",
        f"| `LinkStore.restore` with a copying view sink | {_us(ms)} | {gbs(ms):.2f} GB/s "
        f"| {mp / ms:.2f} | {ps:.2f} |",
        f"| reference: plain copy in the restore's {len(chunks)} chunks, one buffer to one "
        f"buffer | {_us(mc)} | {gbs(mc):.2f} GB/s | {mp / mc:.2f} | {pc:.2f} |",
        "",
        "Goal: ratio >= 0.8. The headline is the median of paired ratios: on a CPU shared "
        "with other jobs, memory bandwidth changes from one second to the next, and pairing "
        "each restore with the plain copy run just before it cancels most of that; the best "
        "times are shown too. For token-granular views the assembly is one `torch.cat` per "
        "view over the chain's stored rows, written straight into the destination; the "
        "chunked reference row shows what copying in per-link pieces costs by itself. The "
        "view-sink path hands each link's rows to a Python callback (the adapter's path into "
        "paged blocks), which adds one call per link and view.",
        "",
    ]
    return lines


# ---------------------------------------------------------------------------------- 3. memory
def bench_bookkeeping(quick: bool) -> list[str]:
    rng = np.random.default_rng(2)
    n = 2_000 if quick else 10_000
    tree = SnapshotTree(REF_LAYOUT, TreeConfig(budget_bytes=BIG, memory_floor_bytes=0))
    prompts = [rng.integers(0, 150_000, 4 * GRID) for _ in range(n // 4)]
    keys = [tree.keys(p) for p in prompts]
    for k in keys:  # hash outside the measurement: PromptKeys belong to the request
        for c in range(GRID, 4 * GRID + 1, GRID):
            k.digest(c)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k in keys:
        for c in range(GRID, 4 * GRID + 1, GRID):
            r = tree.reserve(k, c, DOMAIN)
            tree.commit(r.link_id)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_link_tree = (after - before) / len(tree)
    tokens_part = GRID * 8
    payload = REF_LAYOUT.link_bytes(GRID)
    payload_small = REF_LAYOUT.link_bytes(MSG_MIN)

    # Worker side: per-link objects of the store (payload excluded), measured in a fresh
    # interpreter as RSS growth minus the payload bytes, with tiny links so that the payload
    # does not hide the rest (in this process, freed memory of the earlier sections would be
    # reused and hide the growth). Measured with 1 and with 5 views, since a sealed link keeps
    # one typed tensor per view; the reference layout's cost is extrapolated from the two.
    m = 5_000 if quick else 20_000

    def store_overhead(n_views: int) -> float:
        code = (
            "import gc, psutil, torch\n"
            "from vllm_hybridcache.core import LinkStore, SectionSpec, StateLayout, ViewSpec\n"
            "lay = StateLayout(sections=(SectionSpec('s', (16,), 'float32'),),"
            f" views=tuple(ViewSpec(f'v{{i}}', (16,), 'bfloat16') for i in range({n_views})))\n"
            "st = LinkStore(lay, pin_memory=False)\n"
            "st.allocate(-1, 2); st.seal(-1); gc.collect()\n"
            "p = psutil.Process(); r0 = p.memory_info().rss\n"
            f"for i in range({m}):\n"
            "    st.allocate(i, 2); st.seal(i)\n"
            "r1 = p.memory_info().rss\n"
            "payload = st.bytes_held - st.padding_bytes(2) - lay.link_bytes(2)\n"
            f"print((r1 - r0 - payload) / {m})\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        return float(out.stdout.strip().splitlines()[-1])

    one, five = store_overhead(1), store_overhead(5)
    per_view = max(0.0, (five - one) / 4)
    store_base = max(0.0, one - per_view)
    per_link_store = store_base + per_view * len(REF_LAYOUT.views)
    pad = LinkStore(REF_LAYOUT, pin_memory=False).padding_bytes(GRID)
    total_overhead = per_link_tree + per_link_store
    lines = [
        "## 3. Bookkeeping memory per link",
        "",
        f"Tree (scheduler side): {len(tree):,} links of {GRID} tokens, measured with "
        "tracemalloc around reserve + commit (PromptKeys belong to the request and are not "
        "counted).",
        f"Store (worker side): {m:,} tiny links allocated in a fresh interpreter, RSS growth "
        "minus payload bytes (tensor objects, entry, the allocator's own overhead), with 1 and "
        "with 5 views; extrapolated to the reference layout's "
        f"{len(REF_LAYOUT.views)} views.",
        "",
        "| item | bytes per link |",
        "|---|---|",
        f"| tree metadata, total | {per_link_tree:,.0f} |",
        f"| of which the link's own tokens ({GRID} x int64, needed for verification) "
        f"| {tokens_part:,} |",
        f"| store, per link (one uint8 buffer + entry) | {store_base:,.0f} |",
        f"| store, per view of a sealed link (its typed row tensor) | {per_view:,.0f} |",
        f"| store, reference layout ({len(REF_LAYOUT.views)} views) | {per_link_store:,.0f} |",
        f"| store alignment padding, reference layout, {GRID}-row link | {pad} |",
        "",
        "Relative to the payload of the reference layout (27 GDN + 9 attention layers; "
        f"sections {_fmt_bytes(REF_LAYOUT.section_bytes)}, "
        f"{_fmt_bytes(REF_LAYOUT.view_bytes_per_row)} per row):",
        "",
        "| link | payload | bookkeeping | share |",
        "|---|---|---|---|",
        f"| {GRID}-row link | {_fmt_bytes(payload)} | {total_overhead:,.0f} B "
        f"| {100 * total_overhead / payload:.4f} % |",
        f"| {MSG_MIN}-row link (shortest message-end link) | {_fmt_bytes(payload_small)} "
        f"| {total_overhead - tokens_part + MSG_MIN * 8:,.0f} B "
        f"| {100 * (total_overhead - tokens_part + MSG_MIN * 8) / payload_small:.4f} % |",
        "",
        "Goal: under 1 %. Per token, the tree keeps 8 bytes against "
        f"{_fmt_bytes(REF_LAYOUT.view_bytes_per_row)} of view rows "
        f"({100 * 8 / REF_LAYOUT.view_bytes_per_row:.3f} %).",
        "",
    ]
    return lines


# ---------------------------------------------------------------------------------- 4. policy
@dataclass
class Conv:
    """One conversation: token messages; the prompt is their concatenation."""

    head: int
    msgs: list[np.ndarray] = field(default_factory=list)
    turns_left: int = 0
    parent: Conv | None = None

    def prompt(self) -> tuple[np.ndarray, list[int]]:
        toks = np.concatenate(self.msgs)
        ends = np.cumsum([len(m) for m in self.msgs]).tolist()
        return toks, ends


@dataclass
class Workload:
    name: str
    description: str
    requests: list[tuple[np.ndarray, list[int], float]]  # tokens, message ends, clock


def make_workloads(quick: bool, seed: int = 7) -> list[Workload]:
    """Agent-like traces at token level, seeded; each request is (prompt, message ends, t)."""
    rng = np.random.default_rng(seed)
    pyr = random.Random(seed)
    heads = [rng.integers(0, 150_000, int(n)) for n in (3000, 4500, 6000)]
    scale = 0.4 if quick else 0.7

    def msg(lo: int, hi: int) -> np.ndarray:
        return rng.integers(0, 150_000, pyr.randint(lo, hi))

    def new_conv(turns: int, head: int | None = None, parent: Conv | None = None) -> Conv:
        h = pyr.randrange(len(heads)) if head is None else head
        c = Conv(h, [heads[h]], turns, parent)
        c.msgs.append(msg(50, 400))  # first user message / task
        return c

    def step(c: Conv) -> None:
        """The answer to the last request, and the next tool result or user message."""
        c.msgs.append(msg(80, 600))
        c.msgs.append(msg(200, 2500) if pyr.random() < 0.7 else msg(30, 300))
        c.turns_left -= 1

    out: list[Workload] = []

    # A. several sessions sharing heads, used A/B/A: a pool of active sessions, each request
    #    picks one (recently used ones more often); finished sessions are replaced.
    reqs = []
    t = 0.0
    active = [new_conv(pyr.randint(6, 20)) for _ in range(6)]
    for _ in range(int(500 * scale)):
        i = min(int(pyr.expovariate(0.6)), len(active) - 1)
        c = active.pop(i)
        toks, ends = c.prompt()
        reqs.append((toks, ends, t))
        t += 2.0 + len(c.msgs[-1]) / 1000
        step(c)
        if c.turns_left > 0:
            active.insert(0, c)
        else:
            active.append(new_conv(pyr.randint(6, 20)))
    out.append(Workload("interleaved", "6 live sessions on 3 shared heads, A/B/A switching "
                        "(recent sessions favoured), growing 5-40K-token conversations", reqs))

    # B. sub-agents: a parent agent spawns 2-4 sub-agents on its head (own task), runs them
    #    in turn for 2-5 steps each, then continues with their reports.
    reqs = []
    t = 0.0
    parents = [new_conv(pyr.randint(8, 16)) for _ in range(3)]
    while len(reqs) < int(500 * scale):
        p = pyr.choice(parents)
        toks, ends = p.prompt()
        reqs.append((toks, ends, t))
        t += 2.0
        step(p)
        if pyr.random() < 0.35:
            subs = [new_conv(pyr.randint(2, 5), head=p.head, parent=p)
                    for _ in range(pyr.randint(2, 4))]
            while subs:
                s = subs.pop(0)
                toks, ends = s.prompt()
                reqs.append((toks, ends, t))
                t += 1.5
                step(s)
                if s.turns_left > 0:
                    subs.append(s)
            p.msgs.append(msg(200, 800))  # the reports
        if p.turns_left <= 0:
            parents[parents.index(p)] = new_conv(pyr.randint(8, 16))
    out.append(Workload("sub-agents", "3 parent agents spawning 2-4 sub-agents (shared head, "
                        "own task, 2-5 steps, round robin), parents resume with the reports",
                        reqs))

    # C. a long-running session with occasional returns to old ones (A ... B ... A).
    reqs = []
    t = 0.0
    convs = [new_conv(10_000)]
    for _ in range(int(400 * scale)):
        r = pyr.random()
        if r < 0.08:
            convs.append(new_conv(10_000))
        c = convs[-1] if r < 0.8 or len(convs) == 1 else pyr.choice(convs[:-1])
        toks, ends = c.prompt()
        if len(toks) > 60_000:  # context full: the session ends, start another
            convs.remove(c)
            convs.append(new_conv(10_000))
            continue
        reqs.append((toks, ends, t))
        t += 3.0
        step(c)
    out.append(Workload("returns", "one main session growing to 60K tokens, new sessions now "
                        "and then, 20% of requests return to an older session", reqs))
    return out


def replay(wl: Workload, policy: str, budget: int, half_life: float = 600.0) -> dict[str, float]:
    """Run the scheduler-side protocol for every request: lookup, restore, capture new cuts."""
    now = [0.0]
    tree = SnapshotTree(
        REF_LAYOUT,
        TreeConfig(budget_bytes=budget, memory_floor_bytes=0, policy=policy,
                   cost_half_life_s=half_life),
        available_memory=lambda: 1 << 50,
        clock=lambda: now[0],
    )
    served = 0
    hits = 0
    prompt_tokens = 0
    peak = 0
    for toks, ends, t in wl.requests:
        now[0] = t
        keys = tree.keys(toks)
        res = tree.lookup(keys, DOMAIN, len(toks) - 1)
        prompt_tokens += len(toks)
        if tree.begin_restore(res):
            tree.end_restore(res.plan, ok=True)
            hits += 1
            served += res.tokens
        for c in cuts_of(len(toks), ends):
            if c <= res.tokens:
                continue
            r = tree.reserve(keys, c, DOMAIN)
            if r.link_id is not None:
                tree.commit(r.link_id)
        peak = max(peak, tree.bytes_held)
        tree.drain_dropped()
    return {"hits": hits, "served": served, "prompt": prompt_tokens, "peak": peak,
            "requests": len(wl.requests)}


def bench_policies(quick: bool) -> tuple[list[str], str]:
    workloads = make_workloads(quick)
    fractions = (0.05, 0.1, 0.2, 0.4)
    lines = [
        "## 4. Eviction policies on agent-like access patterns",
        "",
        f"Seeded token-level traces; segmentation every {GRID} tokens plus message ends at "
        f"least {MSG_MIN} tokens after the previous cut; reference layout "
        f"({_fmt_bytes(REF_LAYOUT.link_bytes(GRID))} per {GRID}-row link). Each request "
        "runs the adapter's protocol: lookup (limit = len - 1), restore, capture the new cuts. "
        "Budgets are fractions of the bytes the unlimited tree ends up holding. "
        "`served` = prompt tokens restored instead of prefilled; `ideal` = unlimited budget.",
        "",
    ]
    totals = {"lru": 0.0, "cost": 0.0}
    hl_totals: dict[float, float] = {}
    lru10 = 0.0
    for wl in workloads:
        ideal = replay(wl, "lru", BIG)
        lines += [
            f"### {wl.name}: {wl.description}",
            "",
            f"{ideal['requests']} requests, {ideal['prompt']:,} prompt tokens; unlimited "
            f"budget: {ideal['hits']} hits, {ideal['served']:,} tokens served "
            f"({100 * ideal['served'] / ideal['prompt']:.1f} % of prompt tokens), "
            f"{_fmt_bytes(ideal['peak'])} held.",
            "",
            "| budget | LRU hits | LRU served (% of ideal) | cost hits | cost served "
            "(% of ideal) | cost / LRU |",
            "|---|---|---|---|---|---|",
        ]
        for f in fractions:
            budget = int(ideal["peak"] * f)
            a = replay(wl, "lru", budget)
            b = replay(wl, "cost", budget)
            totals["lru"] += a["served"] / ideal["served"]
            totals["cost"] += b["served"] / ideal["served"]
            lines.append(
                f"| {f:.0%} ({_fmt_bytes(budget)}) | {a['hits']} "
                f"| {a['served']:,} ({100 * a['served'] / ideal['served']:.1f} %) "
                f"| {b['hits']} | {b['served']:,} ({100 * b['served'] / ideal['served']:.1f} %) "
                f"| {b['served'] / max(a['served'], 1):.3f} |"
            )
            if f == 0.1:
                lru10 += a["served"] / ideal["served"]
                hl_totals[600.0] = hl_totals.get(600.0, 0.0) + b["served"] / ideal["served"]
                for hl in (60.0,):
                    c = replay(wl, "cost", budget, half_life=hl)
                    hl_totals[hl] = hl_totals.get(hl, 0.0) + c["served"] / ideal["served"]
        lines.append("")
    n = len(workloads) * len(fractions)
    winner = "cost" if totals["cost"] > totals["lru"] else "lru"
    lines += [
        f"Mean share of the ideal tokens served over {n} (workload, budget) cells: "
        f"LRU {100 * totals['lru'] / n:.1f} %, cost {100 * totals['cost'] / n:.1f} %. "
        f"**Winner: {winner}** (TreeConfig.policy default).",
        "",
        "The winner is chosen on tokens served, the prefill a cache saves, not on the hit "
        "count: a hit on a shared head and a hit 40K tokens deep count the same as hits but "
        "differ a hundredfold in work saved.",
        "",
    ]
    if hl_totals:
        cells = ", ".join(f"{hl:g} s: {100 * v / len(workloads):.1f} %"
                          for hl, v in sorted(hl_totals.items()))
        lines += [f"Cost policy half-life at the 10 % budget (mean share of ideal over the "
                  f"workloads; LRU: {100 * lru10 / len(workloads):.1f} %): {cells}.", ""]
    return lines, winner


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke check)")
    ap.add_argument("--only", choices=("latency", "restore", "memory", "policy"), default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cmd = "python -m benchmarks.core_bench" + (" --quick" if args.quick else "")
    if args.only:
        cmd += f" --only {args.only}"
    out = [
        "# Cache core benchmarks",
        "",
        f"Command: `{cmd}` (benchmarks/core_bench.py). Machine: {platform.machine()}, "
        f"{psutil.cpu_count(logical=True)} logical CPUs shared with other jobs, "
        f"Python {platform.python_version()}, torch {torch.__version__}, 1 torch thread; "
        f"load average at start {os.getloadavg()[0]:.1f} (timings are noisy when it exceeds "
        "the CPU count; the policy tables are deterministic).",
        "",
    ]
    sections: dict[str, Callable[[bool], list[str]]] = {
        "latency": bench_latency, "restore": bench_restore, "memory": bench_bookkeeping,
    }
    for name, fn in sections.items():
        if args.only in (None, name):
            t1 = time.perf_counter()
            out += fn(args.quick)
            out.append(f"_Section time: {time.perf_counter() - t1:.0f} s._")
            out.append("")
            print("\n".join(out), flush=True)
            out = []
    if args.only in (None, "policy"):
        t1 = time.perf_counter()
        lines, _ = bench_policies(args.quick)
        out += lines
        out.append(f"_Section time: {time.perf_counter() - t1:.0f} s._")
        out.append("")
    out.append(f"Total benchmark time: {time.perf_counter() - t0:.0f} s.")
    print("\n".join(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
