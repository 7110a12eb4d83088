"""End anchors (live continuation) with MTP speculative decoding (flash-next-tiny, float32, k = 2).

With drafts, a request's last step is a verify step: it forwards the last sampled token and k
draft tokens, writes the recurrent state after its j-th token to the j-th state block, and its
K/V rows for all of them; only the accepted ones count. The end anchor therefore holds the
rows before the request's end and the state block of the last accepted token, and its draft
head's last row read the request's last sampled token, so it is served only to a next turn
that continues with that token. Held to the same greedy gate as on the AR route
(test_end_anchors.py), with the same negative control; the draft acceptance of the resumed
turns equals that of their cold runs.
"""

from __future__ import annotations

import pytest

from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_end_anchors import greedy_gate
from tests.connector.test_exactness import GRID, anchored_session, clear, run
from vllm_hybridcache.instrumentation import instrument

pytestmark = pytest.mark.slow

SPEC = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def llm(inproc, embedded_model):
    with connector_engine(embedded_model("flash-next-tiny"), dtype="float32",
                          extra={"grid": GRID, "message_end_min": 64},
                          speculative_config=SPEC, disable_log_stats=False) as engine:
        instrument(engine)          # state probes: the "state" of run()
        yield engine


def _spec_counts(llm) -> tuple[int, int]:
    """(draft tokens proposed, draft tokens accepted) so far in this engine."""
    got = {m.name: m.value for m in llm.get_metrics()
           if m.name in ("vllm:spec_decode_num_draft_tokens",
                         "vllm:spec_decode_num_accepted_tokens")}
    return (int(got.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(got.get("vllm:spec_decode_num_accepted_tokens", 0)))


def test_anchors_are_on_with_drafts(llm):
    sched, _ = engine_parts(llm)
    assert sched.base_domain["route"] == "mtp"
    assert sched.anchors.enabled


def test_live_continuation_with_drafts_passes_the_greedy_gate(llm):
    """Five turns, each the previous prompt + its answer + a new message: every turn resumes at
    the previous turn's end anchor, agrees with a cold run of its prompt, and the drafts of the
    resumed turns are accepted as often as those of the cold runs."""
    d0 = _spec_counts(llm)
    turns = anchored_session(llm)
    d1 = _spec_counts(llm)
    agreed, colds = [], []
    for p, out in turns[1:]:
        clear(llm)
        colds.append(run(llm, p))
        agreed.append(greedy_gate(out, colds[-1]))
    d2 = _spec_counts(llm)
    assert sum(agreed) >= len(agreed) * len(turns[0][1]["tokens"]) // 2, agreed
    assert d1[0] > d0[0]                              # the drafts really ran
    # acceptance on the same trace, cache on vs off: the anchored session's turns 2-6 (its
    # counts less turn 1's, measured again cold) against their cold runs
    clear(llm)
    assert run(llm, turns[0][0])["tokens"] == turns[0][1]["tokens"]
    d3 = _spec_counts(llm)
    warm = (d1[0] - d0[0] - (d3[0] - d2[0]), d1[1] - d0[1] - (d3[1] - d2[1]))
    cold = (d2[0] - d1[0], d2[1] - d1[1])
    if any(w["tokens"] != c["tokens"] for (_, w), c in zip(turns[1:], colds, strict=True)):
        pytest.skip("a cold tie changed a turn's tokens: its drafts differ by design")
    assert warm == cold, (warm, cold)


def test_greedy_gate_catches_a_corrupted_anchor_with_drafts(llm):
    """Negative control: the same gate fails on a resumed run whose anchor was corrupted."""
    clear(llm)
    p = [200 + (i * 41) % 2500 for i in range(300)]
    first = run(llm, p)
    nxt = p + first["tokens"] + [11 + (i * 3) % 500 for i in range(30)]
    clear(llm)
    cold = run(llm, nxt)
    clear(llm)
    run(llm, p)
    _, worker = engine_parts(llm)
    run(llm, [1, 2, 3])  # one more step: the anchor's copy lands and is committed
    clean = run(llm, nxt)
    assert clean["cached"] == len(p) + len(first["tokens"]) - 1
    assert greedy_gate(clean, cold) == len(cold["tokens"])     # the intact anchor passes
    clear(llm)
    run(llm, p)
    run(llm, [1, 2, 3])
    for link_id in list(worker.store._entries):
        bufs = worker.store.buffers(link_id)
        for t in (*bufs.sections.values(), *bufs.views.values()):
            if t.is_floating_point():   # states and K/V rows; the PLE n-gram context holds ids
                t.mul_(-1.0).add_(0.5)
    warm = run(llm, nxt)
    assert warm["cached"] == len(p) + len(first["tokens"]) - 1
    with pytest.raises(AssertionError, match=r"position \d: logprobs moved"):
        greedy_gate(warm, cold)


def test_an_anchor_needs_the_next_token_its_draft_row_read(llm):
    """The anchor's last draft row read the request's last sampled token: a next turn that
    continues with another token resumes at the tree's link instead (both turns end in the
    first prompt's last token, which the tree link's draft row read), never at the anchor."""
    clear(llm)
    p = [200 + (i * 43) % 2500 for i in range(300)]
    first = run(llm, p)
    run(llm, [1, 2, 3])
    other = [*p, *first["tokens"][:-1], first["tokens"][-1] + 1, 5, 6, p[-1]]
    assert run(llm, other)["cached"] == GRID
    clear(llm)                      # `other` replaced p's anchor with its own: take it again
    assert run(llm, p)["tokens"] == first["tokens"]
    run(llm, [1, 2, 3])
    same = [*p, *first["tokens"], 5, 6, p[-1]]
    assert run(llm, same)["cached"] == len(p) + len(first["tokens"]) - 1
