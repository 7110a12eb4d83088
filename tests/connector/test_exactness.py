"""Warm (restored) prefills equal cold prefills of the same prompt, bit for bit.

Prompt A spans 3 grid segments plus a tail; B shares A's first 2 segments; A again. Every warm
run must report the deepest shared cut as cached, and give the same greedy tokens, the same
logprobs (float equality) and the same final state parts (sha256 of every section and complete
KV block) as a cold run of the same prompt in the same engine. A corrupted link must make the
comparison fail (negative control), and a failed restore must fall back to an exact cold run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from vllm_hybridcache.adapter.domain import request_domain
from vllm_hybridcache.testing.instrumentation import instrument, instrumentation_of

pytestmark = pytest.mark.slow

GRID = 256
A = [100 + (i * 7) % 3000 for i in range(3 * GRID + 132)]          # 3 segments + tail
B = A[: 2 * GRID] + [50 + (i * 13) % 3000 for i in range(300)]     # shares 2 segments
C = [7 + (i * 11) % 3000 for i in range(GRID + 40)]                # unrelated


@pytest.fixture(scope="module")
def llm(inproc, embedded_model):
    # Step mode on purpose (`inner_captures` off), also where the suite runs with the CPU
    # attention pin turned on (VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT=1, which puts this
    # model in fine mode): these tests count hits at grid and message-end cuts. Fine mode
    # (links also at the prompt's last 64-aligned position and at junctions) is checked bit for
    # bit in test_fine_cuts_qwen3_next.py and test_attention_in_place.py.
    with connector_engine(embedded_model("qwen3-next-tiny"),
                          extra={"grid": GRID, "message_end_min": 64,
                                 "inner_captures": False}) as engine:
        instrument(engine)          # state probes at each prefill's end: the "state" of run()
        yield engine


def run(llm, prompt, salt: str | None = None, prompt_logprobs: bool = False):
    from vllm import SamplingParams

    # vLLM returns no valid prompt logprobs for cached positions, so it skips cache reads for
    # requests that ask for them (its default); we keep that default.
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=5,
                        prompt_logprobs=1 if prompt_logprobs else None, detokenize=False)
    p = {"prompt_token_ids": list(prompt)}
    if salt is not None:
        p["cache_salt"] = salt
    out = llm.generate([p], sp, use_tqdm=False)[0]
    return {
        "tokens": list(out.outputs[0].token_ids),
        "cached": out.num_cached_tokens,
        "logprobs": [{k: v.logprob for k, v in d.items()} for d in out.outputs[0].logprobs],
        "prompt_logprobs": out.prompt_logprobs,
        "state": instrumentation_of(llm).take_digests(out.request_id),
    }


def clear(llm):
    sched, _ = engine_parts(llm)
    sched.clear()


def check_chain_and_branch(llm) -> dict:
    """A and B cold, then A (links at 256, 512, 768), B (resumes at A's 2nd cut) and A again
    (the deepest cut: a 3-link chain) warm: each equals its cold run in tokens, logprobs and
    state. Returns A's cold run. Shared by the exactness tests of every checkpoint."""
    clear(llm)
    a_cold = run(llm, A)
    assert a_cold["cached"] == 0 and a_cold["state"]
    clear(llm)
    b_cold = run(llm, B)
    clear(llm)

    run(llm, A)                      # captures links at 256, 512, 768
    b_warm = run(llm, B)             # resumes at A's 2nd cut
    a_warm = run(llm, A)             # resumes at the deepest cut: a 3-link chain
    assert b_warm["cached"] == 2 * GRID
    assert a_warm["cached"] == 3 * GRID
    for warm, cold in ((a_warm, a_cold), (b_warm, b_cold)):
        assert warm["tokens"] == cold["tokens"]
        assert warm["logprobs"] == cold["logprobs"]
        assert warm["state"] == cold["state"]
    return a_cold


def corrupt_links(llm) -> None:
    """Negative control: every stored link's first state section off by one."""
    _, worker = engine_parts(llm)
    for link_id in list(worker.store._entries):
        first = next(iter(worker.store.buffers(link_id).sections.values()))
        first.add_(torch.ones_like(first))


def test_warm_runs_equal_cold_runs(llm):
    check_chain_and_branch(llm)


def test_chain_and_shared_root(llm):
    clear(llm)
    run(llm, A)
    run(llm, B)                      # B's link at 768 hangs under A's link at 512
    sched, _ = engine_parts(llm)
    tree = sched.tree
    domain = request_domain(sched.base_domain, SimpleNamespace(cache_salt=None, lora_request=None))
    res_a = tree.lookup(tree.keys(A), domain, len(A) - 1)
    res_b = tree.lookup(tree.keys(B), domain, len(B) - 1)
    assert len(res_a.plan.chain) == 3 and len(res_b.plan.chain) == 3
    assert res_a.plan.chain[:2] == res_b.plan.chain[:2]       # shared root and second link
    assert res_a.plan.chain[2] != res_b.plan.chain[2]


def test_prompt_logprobs_stay_correct(llm):
    """A request asking for prompt logprobs is served cold (every position computed), even with
    links available, and its logprobs equal the cold run's."""
    clear(llm)
    cold = run(llm, A, prompt_logprobs=True)
    run(llm, A)                                  # links now exist for A
    again = run(llm, A, prompt_logprobs=True)
    assert again["cached"] == 0

    def plain(pl):
        return [None if d is None else {k: v.logprob for k, v in d.items()} for d in pl]

    assert plain(again["prompt_logprobs"]) == plain(cold["prompt_logprobs"])
    assert again["tokens"] == cold["tokens"] and again["logprobs"] == cold["logprobs"]


def test_corrupted_link_is_caught(llm):
    """Negative control: the comparison above detects a bad restore."""
    clear(llm)
    cold = run(llm, A)
    corrupt_links(llm)
    warm = run(llm, A)
    assert warm["cached"] == 3 * GRID
    assert warm["logprobs"] != cold["logprobs"] or warm["state"] != cold["state"]
    clear(llm)


def test_failed_restore_falls_back_to_cold(llm):
    clear(llm)
    cold = run(llm, A)
    sched, _ = engine_parts(llm)
    failed_before = sched.tree.stats().restores_failed

    def boom(kind, job):
        if kind == "load":
            raise RuntimeError("injected restore failure")

    inst = instrumentation_of(llm)
    inst.fault = boom
    try:
        again = run(llm, A)
    finally:
        inst.fault = None
    assert sched.tree.stats().restores_failed == failed_before + 1
    assert again["tokens"] == cold["tokens"] and again["logprobs"] == cold["logprobs"]
    assert again["state"] == cold["state"]


def test_cache_salt_never_shares(llm):
    """Another tenant's links are never served, and its miss is a plain `no_prefix`: nothing
    says that tenant-1 holds the prompt (issue 29; `domain_mismatch` is only for another
    domain of the same tenant)."""
    clear(llm)
    sched, _ = engine_parts(llm)
    run(llm, A, salt="tenant-1")
    before = dict(sched.tree.stats().misses)
    other = run(llm, A, salt="tenant-2")
    after = dict(sched.tree.stats().misses)
    same = run(llm, A, salt="tenant-1")
    assert other["cached"] == 0
    assert same["cached"] == 3 * GRID
    assert after.get("no_prefix", 0) == before.get("no_prefix", 0) + 1
    assert after.get("domain_mismatch", 0) == before.get("domain_mismatch", 0)


def test_batched_sessions_get_their_own_state(llm):
    from vllm import SamplingParams

    clear(llm)
    solo = {name: run(llm, p)["tokens"] for name, p in (("A", A), ("B", B), ("C", C))}
    sp = SamplingParams(max_tokens=6, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in (A, B, C)], sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [solo["A"], solo["B"], solo["C"]]
    assert outs[0].num_cached_tokens == 3 * GRID and outs[1].num_cached_tokens == 3 * GRID


def test_message_end_links_are_cold_exact_and_shared(llm, embedded_model):
    """A sub-agent with the same head hits at the head's <|im_end|>, off the grid."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model("qwen3-next-tiny"))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # grid cut at 256, then <|im_end|> 94 tokens later (>= message_end_min 64): a cut at 350
    head = [300 + (i * 17) % 2000 for i in range(349)] + [im_end]
    x = head + [40 + (i * 3) % 900 for i in range(120)]
    y = head + [60 + (i * 5) % 900 for i in range(90)]
    clear(llm)
    y_cold = run(llm, y)
    clear(llm)
    run(llm, x)
    y_warm = run(llm, y)
    assert y_warm["cached"] == 350
    assert y_warm["tokens"] == y_cold["tokens"]
    assert y_warm["logprobs"] == y_cold["logprobs"]
    assert y_warm["state"] == y_cold["state"]


def test_live_continuation_resumes_at_each_end_anchor(llm):
    """Five turns, each the previous prompt + its answer + a new message: every turn resumes at
    the previous turn's end anchor (GDN sections and attention blocks of qwen3-next). The
    anchor's state comes from decode steps, so its tokens are compared with cold runs by the
    greedy gate in float32 (test_end_anchors.py): in bf16 the decode-vs-prefill drift depends
    on the CPU's kernels (up to 0.16 nats here with AVX2 kernels) and flips near-ties."""
    anchored_session(llm)


def test_an_anchor_hit_in_place_equals_the_same_hit_copied(llm, monkeypatch):
    """Issue 33, item 2, with `anchor_in_place` on (off by default): an end-anchor hit takes
    the attention blocks below its cold rows from vLLM's prefix cache (shared, not copied). In
    one engine the same anchor is restored twice: in place, and with every row copied from the
    anchor (the default); both resumed turns give the same greedy tokens, logprobs (float
    equality) and final state parts. The second turn's blocks below the anchor's cold rows are
    then vLLM's, not a copy."""
    import msgspec

    sched, _ = engine_parts(llm)
    assert sched.in_place_block > 0
    p1 = [300 + (i * 29) % 2500 for i in range(1200)]

    def turn(copy_rows: bool) -> dict:
        monkeypatch.setattr(sched, "settings",
                            msgspec.structs.replace(sched.settings, anchor_in_place=True))
        clear(llm)
        first = run(llm, p1)                     # cold: leaves its end anchor
        assert first["cached"] == 0
        sched.clear("ram", "tree")               # the anchor is the only hit
        p2 = p1 + first["tokens"] + [900 + (i * 5) % 700 for i in range(60)]
        before = sched.in_place_stats("ram", "anchor")["tokens_in_place"]
        if copy_rows:
            rows = sched._sharable_rows
            monkeypatch.setattr(sched, "_sharable_rows", lambda request, entry, res:
                                0 if res.kind == "anchor" else rows(request, entry, res))
        out = run(llm, p2)
        monkeypatch.undo()
        assert out["cached"] == len(p1) + len(first["tokens"]) - 1   # the end anchor
        out["in_place"] = sched.in_place_stats("ram", "anchor")["tokens_in_place"] - before
        return out

    shared, copied = turn(copy_rows=False), turn(copy_rows=True)
    block = sched.in_place_block
    depth = shared["cached"]
    # the whole blocks below the anchor and within its cold rows (the prompt it prefilled)
    assert shared["in_place"] == min((depth - 1) // block, len(p1) // block) * block > 0
    assert copied["in_place"] == 0
    assert shared["tokens"] == copied["tokens"]
    assert shared["logprobs"] == copied["logprobs"]
    assert shared["state"] == copied["state"]


def anchored_session(llm) -> list[tuple[list[int], dict]]:
    """Six turns from a clear cache, each the previous prompt + its answer + a new message;
    asserts every later turn resumed at the previous turn's end anchor. Returns the turns."""
    clear(llm)
    prompt = [200 + (i * 31) % 2500 for i in range(300)]
    turns = []
    for t in range(6):
        out = run(llm, prompt)
        turns.append((list(prompt), out))
        prompt = prompt + out["tokens"] + [900 + (i * 7 + t) % 700 for i in range(40 + 10 * t)]
    sched, _ = engine_parts(llm)
    session = sched.anchors.stats()
    for t, (_, out) in enumerate(turns[1:], start=1):
        prev_p, prev = turns[t - 1]
        assert out["cached"] == len(prev_p) + len(prev["tokens"]) - 1   # the end anchor
    assert session.hits == 5 and session.tokens_served == sum(o["cached"] for _, o in turns)
    return turns


def test_end_anchor_is_never_served_to_another_salt(llm):
    clear(llm)
    p = [200 + (i * 37) % 2500 for i in range(300)]
    first = run(llm, p, salt="alice")
    nxt = p + first["tokens"] + [5, 6, 7, 8]
    assert run(llm, nxt, salt="bob")["cached"] == 0        # tree links are per tenant too
    assert run(llm, nxt, salt="alice")["cached"] == len(p) + len(first["tokens"]) - 1


def _links(llm) -> set[int]:
    """Token depths of the committed links in the tree."""
    from vllm_hybridcache.core.tiers.ram_tree import COMMITTED

    sched, _ = engine_parts(llm)
    return {link.p for link in sched.tree._links.values() if link.state == COMMITTED}


def _step_until(engine, done) -> list:
    outs = []
    for _ in range(200):
        if done():
            return outs
        outs += engine.step()
    raise AssertionError("engine did not get there in 200 steps")


def test_preempted_prefill_publishes_nothing_more_and_stays_exact(llm):
    """vLLM's own preemption (reset_prefix_cache(reset_running_requests=True) preempts every
    running request, as memory pressure does) in the middle of A's prefill: the links
    committed before it stay, the resumed request captures nothing, its output equals cold."""
    from vllm import SamplingParams

    clear(llm)
    cold = run(llm, A)
    clear(llm)
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=5, detokenize=False)
    engine.add_request("preempted", {"prompt_token_ids": A}, sp)
    _step_until(engine, lambda: _links(llm) == {GRID})          # first segment captured
    assert llm.reset_prefix_cache(reset_running_requests=True)   # preempt it mid-prefill
    outs = _step_until(engine, lambda: not engine.has_unfinished_requests())
    outs += engine.step() if engine.has_unfinished_requests() else []
    final = [o for o in outs if o.finished]
    assert len(final) == 1
    out = final[0].outputs[0]
    assert list(out.token_ids) == cold["tokens"]
    assert [{k: v.logprob for k, v in d.items()} for d in out.logprobs] == cold["logprobs"]
    assert _links(llm) == {GRID}            # nothing captured after the preemption
    again = run(llm, A)                      # a fresh request resumes there and is exact
    assert again["cached"] == GRID and again["tokens"] == cold["tokens"]
    assert again["state"] == cold["state"]
    assert _links(llm) == {GRID, 2 * GRID, 3 * GRID}


def test_aborted_prefill_publishes_only_confirmed_links(llm):
    from vllm import SamplingParams

    clear(llm)
    engine = llm.llm_engine
    sched, _ = engine_parts(llm)
    sp = SamplingParams(max_tokens=6, temperature=0, detokenize=False)
    engine.add_request("aborted", {"prompt_token_ids": A}, sp)
    _step_until(engine, lambda: _links(llm) == {GRID, 2 * GRID})
    engine.abort_request(["aborted"])
    _step_until(engine, lambda: not engine.has_unfinished_requests())
    engine.step()                            # any report of the last step arrives
    assert _links(llm) == {GRID, 2 * GRID}
    assert sched.tree.stats().links_pending == 0  # no reservation left behind
    cold_b = run(llm, B)
    assert cold_b["cached"] == 2 * GRID
