"""MTP speculative decoding with the cache on (flash-next-tiny, k = 1, 2, 3 draft tokens).

The draft head's own K/V rows are one more KV-cache group, so links carry them like any view,
and vLLM defers the connector's save until the draft model has run, so the rows a link copies
are the ones the draft wrote in that step. One row per link is special: the draft head's row
at a step's last position p - 1 reads one more token, which vLLM's default (padded-batch)
proposer takes from the prompt's last token. A link at cut p therefore fits every prompt that
shares the tokens up to the cut and ends in the same token (every chat prompt ends in the same
generation prompt): extensions, branches at the cut or after it, chains of links. A prompt with
another last token is refused (counted as shortened), and restoring it anyway changes the draft
head's rows and nothing else, which the forced restore below shows.
Warm runs must equal cold runs (tokens, logprobs, every state part, the draft head's rows
included). Links are keyed by route: an engine with MTP records `mtp`, and AR and MTP links
never meet. (Greedy tokens with MTP equal those without it: tests/flash_next/test_mtp.py.)
"""

from __future__ import annotations

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_exactness import GRID, A, clear, run
from vllm_hybridcache.instrumentation import instrument

pytestmark = pytest.mark.slow

LAST = A[-1]
X = [30 + (i * 17) % 2900 for i in range(200)]
Y = [60 + (i * 19) % 2900 for i in range(150)]
PROMPTS = {
    "A": A,                                      # 3 grid cuts + a tail
    "ext": A + X + [LAST],                       # extends A, same last token: 3-link chain
    "branch_at_cut": A[: 2 * GRID] + Y + [LAST],         # parts from A at the cut
    "branch_after_cut": A[: 2 * GRID + 1] + Y + [LAST],  # parts one token after the cut
    "ext_other_last": A + X,                     # extends A, another last token: no link fits
}
# tokens each warm run resumes at after a run of A (and of the prompts before it)
EXPECTED = {"A": 3 * GRID, "ext": 3 * GRID, "branch_at_cut": 2 * GRID,
            "branch_after_cut": 2 * GRID, "ext_other_last": 0}
assert Y[0] != A[2 * GRID] and X[-1] != LAST


@pytest.fixture(scope="module")
def model_path(embedded_model):
    return embedded_model("flash-next-tiny")


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda k: f"k{k}")
def llm(request, inproc, model_path):
    spec = {"method": "mtp", "num_speculative_tokens": request.param}
    with connector_engine(model_path, extra={"grid": GRID}, dtype="float32",
                          speculative_config=spec) as engine:
        instrument(engine)          # state probes: the "state" of run()
        yield engine


def _draft_views(sched) -> list[str]:
    """The views (K/V row parts) of the draft head's layers (vLLM names them `mtp.layers.N`)."""
    return [v.name for v in sched.parts.layout.views if v.name.startswith("mtp.")]


def test_links_record_the_mtp_route_and_carry_the_draft_rows(llm):
    sched, _ = engine_parts(llm)
    assert sched.base_domain["route"] == "mtp"       # AR engines record "ar": never shared
    assert sched._draft_reads == "last"              # vLLM's padded drafter batch
    assert sched.anchors.enabled                     # end anchors: test_mtp_anchors.py
    assert _draft_views(sched), sched.parts.layout.views


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
    # only the prompt with another last token was refused a deeper link
    assert sched.tree.stats().shortened == shortened + 1
    for name, warm in warms.items():
        cold = colds[name]
        assert warm["tokens"] == cold["tokens"], name
        assert warm["logprobs"] == cold["logprobs"], name
        assert warm["state"] == cold["state"], name      # the draft head's rows included


def test_a_link_refused_for_another_last_token_really_differs(llm, monkeypatch):
    """Shortened means unusable: restoring A's chain for a prompt with another last token
    (the fits predicate switched off for this request) leaves draft-head rows that differ from
    its cold run, and nothing else: the target's parts, tokens and logprobs stay equal."""
    p = PROMPTS["ext_other_last"]
    clear(llm)
    cold = run(llm, p)
    clear(llm)
    run(llm, A)
    sched, _ = engine_parts(llm)
    monkeypatch.setattr(sched, "_draft_reads", None)   # new requests: no draft tag, no fits
    forced = run(llm, p)
    monkeypatch.undo()
    clear(llm)
    assert forced["cached"] == 3 * GRID
    names = set(_draft_views(sched))
    assert any(forced["state"][n] != cold["state"][n] for n in names)
    assert {k: v for k, v in forced["state"].items() if k not in names} == {
        k: v for k, v in cold["state"].items() if k not in names}
    assert forced["tokens"] == cold["tokens"] and forced["logprobs"] == cold["logprobs"]


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
