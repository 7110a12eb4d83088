"""MTP speculative decoding with the cache on (flash-next-tiny, k = 1, 2, 3 draft tokens).

The draft head's own K/V rows are one more KV-cache group, so links carry them like any view,
and vLLM defers the connector's save until the draft model has run, so the rows a link copies
are the ones the draft wrote in that step. One row per link is special: the draft head's row
at a step's last position p - 1 reads one more token, which vLLM's default (padded-batch)
proposer takes from the prompt's last token. Each link keeps the target's hidden row there
(the draft head's other input), and a restore rebuilds that row for the new prompt's token
(adapter/draft_rows.py). So a link at cut p fits every prompt that shares the tokens up to the
cut, whatever comes after: extensions, branches at the cut or after it, chains of links, with
the capturing prompt's last token or another one; nothing is refused (shortened). Restoring
without the rebuild leaves draft-head rows that differ from the cold run for a prompt with
another last token (and nothing else), and corrupting a kept hidden row is caught, which the
negative controls below show.
Warm runs must equal cold runs (tokens, logprobs, every state part, the draft head's rows
included). Links are keyed by route: an engine with MTP records `mtp`, and AR and MTP links
never meet. (Greedy tokens with MTP equal those without it: tests/flash_next/test_mtp.py.)

End anchors (live continuation) with drafts, on the k = 1 and 2 engines: a request's last step
is a verify step that forwards the last sampled token and k drafts, writes the recurrent state
after its j-th token to the j-th state block, and K/V rows for all of them; only the accepted
ones count. The end anchor holds the rows before the request's end and the state block of the
last accepted token; its draft head's last row was written by that step's first draft pass for
the request's last sampled token, and the anchor keeps that pass's hidden row and geometry, so
a restore rebuilds the row for whatever token the next turn continues with. Rebuilt for the
same token it is the row the pass wrote (bit for bit); every resumed turn is held to the same
greedy gate as on the AR route (test_end_anchors.py), with negative controls; the draft
acceptance of the resumed turns equals that of their cold runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_end_anchors import gate_catches_a_corrupted_anchor, greedy_gate
from tests.connector.test_exactness import GRID, A, anchored_session, clear, run
from vllm_hybridcache.adapter import scheduler_side
from vllm_hybridcache.adapter.anchor_end import anchor_end as scheduler_side_anchor_end
from vllm_hybridcache.adapter.draft_rows import DRAFT_INPUT, BoundaryTap
from vllm_hybridcache.adapter.request_state import RequestState
from vllm_hybridcache.testing.instrumentation import instrument

pytestmark = pytest.mark.slow

LAST = A[-1]
X = [30 + (i * 17) % 2900 for i in range(200)]
Y = [60 + (i * 19) % 2900 for i in range(150)]
PROMPTS = {
    "A": A,                                      # 3 grid cuts + a tail
    "ext": A + X + [LAST],                       # extends A, same last token: 3-link chain
    "branch_at_cut": A[: 2 * GRID] + Y + [LAST],         # parts from A at the cut
    "branch_after_cut": A[: 2 * GRID + 1] + Y + [LAST],  # parts one token after the cut
    "ext_other_last": A + X,                     # extends A, another last token: 4-link chain
    "branch_other_last": A[: 2 * GRID + 1] + Y,  # a branch after the cut, another last token
}
# tokens each warm run resumes at after a run of A (and of the prompts before it)
EXPECTED = {"A": 3 * GRID, "ext": 3 * GRID, "branch_at_cut": 2 * GRID,
            "branch_after_cut": 2 * GRID, "ext_other_last": 4 * GRID,  # ext's link at 1024
            "branch_other_last": 2 * GRID}
assert Y[0] != A[2 * GRID] and X[-1] != LAST and Y[-1] != LAST


@pytest.fixture(scope="module")
def model_path(embedded_model):
    return embedded_model("flash-next-tiny")


def _ks(*ks: int):
    """Parametrizes a test over the engines with these numbers of draft tokens (the `llm`
    fixture, one engine per k for the module: pytest groups the tests by k)."""
    return pytest.mark.parametrize("llm", ks, indirect=True, ids=lambda k: f"k{k}")


EVERY_K = _ks(1, 2, 3)
ANCHOR_K = _ks(1, 2)        # the end-anchor tests: k = 3 adds time, not paths


@pytest.fixture(scope="module")
def llm(request, inproc, model_path):
    spec = {"method": "mtp", "num_speculative_tokens": request.param}
    with connector_engine(model_path, extra={"grid": GRID}, dtype="float32",
                          speculative_config=spec, disable_log_stats=False) as engine:
        instrument(engine)          # state probes: the "state" of run()
        yield engine


def _draft_views(sched) -> list[str]:
    """The views (K/V row parts) of the draft head's layers (vLLM names them `mtp.layers.N`)."""
    return [v.name for v in sched.parts.layout.views if v.name.startswith("mtp.")]


@EVERY_K
def test_links_record_the_mtp_route_and_carry_the_draft_rows(llm):
    sched, _ = engine_parts(llm)
    assert sched.base_domain["route"] == "mtp"       # AR engines record "ar": never shared
    assert sched._draft_reads == "rebuild"           # Flash-Next's head, padded drafter batch
    assert any(s.name == DRAFT_INPUT for s in sched.parts.layout.sections)
    assert sched.anchors.enabled                     # end anchors: the tests below
    assert _draft_views(sched), sched.parts.layout.views


@EVERY_K
def test_mtp_warm_equals_cold(llm):
    colds = {}
    for name, p in PROMPTS.items():
        clear(llm)
        colds[name] = run(llm, p)
        assert colds[name]["cached"] == 0 and colds[name]["state"]
    clear(llm)
    sched, _ = engine_parts(llm)
    shortened = sched.tree.stats().shortened
    run(llm, A)
    warms = {name: run(llm, p) for name, p in PROMPTS.items()}
    assert {k: w["cached"] for k, w in warms.items()} == EXPECTED
    assert sched.tree.stats().shortened == shortened      # nothing was refused
    for name, warm in warms.items():
        cold = colds[name]
        assert warm["tokens"] == cold["tokens"], name
        assert warm["logprobs"] == cold["logprobs"], name
        assert warm["state"] == cold["state"], name      # the draft head's rows included


@EVERY_K
def test_without_the_rebuild_another_last_token_differs(llm, monkeypatch):
    """Negative control for the rebuild: restoring A's chain for a prompt with another last
    token without rebuilding the boundary rows (each link's row as A's prefill wrote it) leaves
    draft-head rows that differ from its cold run, and nothing else: the target's parts, tokens
    and logprobs stay equal. So the rebuild is what makes the warm run above equal."""
    p = PROMPTS["ext_other_last"]
    clear(llm)
    cold = run(llm, p)
    clear(llm)
    run(llm, A)
    monkeypatch.setattr(RequestState, "draft_rebuild", lambda self, chain, token: None)
    forced = run(llm, p)
    monkeypatch.undo()
    sched, _ = engine_parts(llm)
    clear(llm)
    assert forced["cached"] == 3 * GRID
    names = set(_draft_views(sched))
    assert any(forced["state"][n] != cold["state"][n] for n in names)
    assert {k: v for k, v in forced["state"].items() if k not in names} == {
        k: v for k, v in cold["state"].items() if k not in names}
    assert forced["tokens"] == cold["tokens"]
    # the logprobs: equal up to the last bits. Other draft rows propose other draft tokens, so
    # the verify steps run on other batches, whose GEMMs may round the target's logits in other
    # bits on some CPUs (seen at 1e-6 on an AMD EPYC with k = 3); the tokens stay the same
    for got, want in zip(forced["logprobs"], cold["logprobs"], strict=True):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-4 for t in want), (got, want)


@EVERY_K
def test_a_corrupted_boundary_input_is_caught(llm):
    """Negative control: the rebuilt rows come from the kept hidden rows; perturbing them
    (a ulp-sized change is enough) changes the restored draft-head rows."""
    p = PROMPTS["ext_other_last"]
    clear(llm)
    cold = run(llm, p)
    clear(llm)
    run(llm, A)
    sched, worker = engine_parts(llm)
    for link_id in list(worker.store._entries):
        h = worker.store.buffers(link_id).sections[DRAFT_INPUT]
        h.copy_(torch.nextafter(h, torch.full_like(h, float("inf"))))
    warm = run(llm, p)
    clear(llm)
    assert warm["cached"] == 3 * GRID
    assert any(warm["state"][n] != cold["state"][n] for n in _draft_views(sched))


@EVERY_K
def test_corrupted_draft_rows_are_caught(llm):
    """Negative control: the state comparison sees a bad restore of the draft head's rows
    (greedy verification would hide it in the tokens)."""
    clear(llm)
    cold = run(llm, A)
    sched, worker = engine_parts(llm)
    names = _draft_views(sched)
    for link_id in list(worker.store._entries):
        views = worker.store.buffers(link_id).views
        for name in names:
            views[name].add_(torch.ones_like(views[name]))
    warm = run(llm, A)
    assert warm["cached"] == 3 * GRID
    assert warm["state"] != cold["state"]
    assert any(warm["state"][n] != cold["state"][n] for n in names)
    clear(llm)

def _spec_counts(llm) -> tuple[int, int]:
    """(draft tokens proposed, draft tokens accepted) so far in this engine."""
    got = {m.name: m.value for m in llm.get_metrics()
           if m.name in ("vllm:spec_decode_num_draft_tokens",
                         "vllm:spec_decode_num_accepted_tokens")}
    return (int(got.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(got.get("vllm:spec_decode_num_accepted_tokens", 0)))


@EVERY_K
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


@EVERY_K
def test_greedy_gate_catches_a_corrupted_anchor_with_drafts(llm):
    """Negative control: the same gate fails on a resumed run whose anchor was corrupted."""
    gate_catches_a_corrupted_anchor(llm)


def _anchored(llm, p: list[int]) -> dict:
    """Run `p` from a clear cache and let its end anchor land (one more step commits it)."""
    clear(llm)
    first = run(llm, p)
    run(llm, [1, 2, 3])
    return first


# 250 tokens + 6 generated: the anchor ends at 255, and its boundary draft row (254) sits in a
# KV block that the next turn (+ 8 new tokens) completes, so the state digests cover it
SESSION = [200 + (i * 43) % 2500 for i in range(250)]
NEW_TEXT = [11 + (i * 3) % 500 for i in range(8)]


def _covered(llm, n: int, prompt: list[int]) -> None:
    """The anchor's boundary row (n - 1) is in a complete block of `prompt` (digested)."""
    sched, _ = engine_parts(llm)
    bt = sched.parts.layout.view_block_tokens
    assert len(prompt) >= ((n - 1) // bt + 1) * bt, (n, bt, len(prompt))


@ANCHOR_K
def test_a_rebuilt_anchor_row_is_the_row_its_decode_pass_wrote(llm, monkeypatch):
    """The next turn is the previous prompt + its answer + new text, so it continues at the
    anchor's end with the request's last sampled token, the token the anchor's boundary draft
    row read in its last verify step. Rebuilt from the kept hidden row on that pass's shape,
    the row is the one the pass wrote: the resumed run equals the run resumed with the row
    left as written, bit for bit (tokens, logprobs, every state part, the draft rows
    included), and passes the greedy gate against a cold run of its prompt.
    Negative controls: the row rebuilt from another row of the pass (a rejected draft's), or
    the target's state block of the last draft (not rolled back), change the state parts."""
    first = _anchored(llm, SESSION)
    nxt = SESSION + first["tokens"] + NEW_TEXT
    n = len(SESSION) + len(first["tokens"]) - 1
    _covered(llm, n, nxt)
    warm = run(llm, nxt)
    assert warm["cached"] == n
    _anchored(llm, SESSION)
    monkeypatch.setattr(RequestState, "anchor_rebuild", lambda self, token: None)
    raw = run(llm, nxt)
    monkeypatch.undo()
    assert raw["cached"] == n
    assert warm["tokens"] == raw["tokens"] and warm["logprobs"] == raw["logprobs"]
    assert warm["state"] == raw["state"]
    clear(llm)
    cold = run(llm, nxt)
    assert greedy_gate(warm, cold) == len(cold["tokens"])
    # a rejected draft's hidden row (the pass's last) instead of the last accepted token's
    sched, _ = engine_parts(llm)
    take = BoundaryTap.take_anchor

    def rejected_row(self, first_block, end, start, length):
        rows = self._verify[first_block][1]
        _, g = take(self, first_block, end, start, length)
        assert end - start < length, "every draft was accepted: no rejected row"
        return rows[-1], g

    monkeypatch.setattr(BoundaryTap, "take_anchor", rejected_row)
    _anchored(llm, SESSION)
    monkeypatch.undo()
    bad_row = run(llm, nxt)
    assert bad_row["cached"] == n
    names = set(_draft_views(sched))
    assert any(bad_row["state"][v] != raw["state"][v] for v in names)
    # the target's state block of the last draft token: not rolled back
    monkeypatch.setattr(scheduler_side, "anchor_end", _last_block)
    _anchored(llm, SESSION)
    monkeypatch.undo()
    bad_block = run(llm, nxt)
    assert bad_block["cached"] == n
    assert any(bad_block["state"][k] != raw["state"][k] for k in raw["state"] if k not in names)


def _last_block(num_computed, num_tokens, prompt_len, last_start, last_len, speculative,
                in_flight=None):
    """anchor_end, but with the state block of the verify step's last token (a rejected
    draft's, while drafts are rejected): the rollback undone."""
    end = scheduler_side_anchor_end(num_computed, num_tokens, prompt_len, last_start, last_len,
                                    speculative, in_flight)
    return None if end is None else (end[0], last_len - 1)


@ANCHOR_K
def test_an_anchor_serves_a_next_turn_with_another_next_token(llm, monkeypatch):
    """A next turn that continues at the anchor's end with another token than the request's
    last sampled one (an answer cut short, a re-rendered stop token) resumes at the anchor:
    its boundary draft row is rebuilt for that token (without the rebuild the draft rows
    differ, nothing else does), and it passes the greedy gate against a cold run."""
    first = _anchored(llm, SESSION)
    other = [*SESSION, *first["tokens"][:-1], first["tokens"][-1] + 1, *NEW_TEXT]
    n = len(SESSION) + len(first["tokens"]) - 1
    _covered(llm, n, other)
    warm = run(llm, other)
    assert warm["cached"] == n
    sched, _ = engine_parts(llm)
    _anchored(llm, SESSION)
    monkeypatch.setattr(RequestState, "anchor_rebuild", lambda self, token: None)
    raw = run(llm, other)
    monkeypatch.undo()
    assert raw["cached"] == n
    names = set(_draft_views(sched))
    assert any(warm["state"][v] != raw["state"][v] for v in names)
    assert {k: v for k, v in warm["state"].items() if k not in names} == {
        k: v for k, v in raw["state"].items() if k not in names}
    clear(llm)
    cold = run(llm, other)
    assert greedy_gate(warm, cold) == len(cold["tokens"])
