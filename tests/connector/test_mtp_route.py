"""MTP speculative decoding with the cache on (flash-next-tiny, one draft token).

The draft head's own K/V rows are one more KV-cache group, so links carry them like any view,
and vLLM defers the connector's save until the draft model has run, so the rows a link copies
are the ones the draft wrote in that step. One row is special: the draft head's row at p - 1 is
computed from one more token, so a link at cut p fits only prompts that give it the same one;
the connector records the tokens it may read (the token after the cut, or, on vLLM's
padded-batch path, the prompt's last token) and serves a shallower link otherwise (counted).
Links are keyed by route: an engine with MTP records `mtp`, and AR and MTP links never meet.
Warm runs must equal cold runs (tokens, logprobs, every state part, the draft head's rows
included), and greedy tokens must equal an engine without speculative decoding or cache.
"""

from __future__ import annotations

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_exactness import GRID, A, B, clear, run
from vllm_hybridcache.instrumentation import instrument

pytestmark = pytest.mark.slow

SPEC = {"method": "mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module")
def model_path(embedded_model):
    return embedded_model("flash-next-tiny")


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy tokens of A and B from an engine without speculative decoding or cache (run
    before the in-process engine exists: one engine per process at a time)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, detokenize=False)
    with connector_engine(model_path, plugin=False, dtype="float32",
                          enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in (A, B)], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llm(reference, inproc, model_path):
    with connector_engine(model_path, extra={"grid": GRID}, dtype="float32",
                          speculative_config=SPEC) as engine:
        instrument(engine)          # state probes: the "state" of run()
        yield engine


def _draft_views(sched) -> list[str]:
    """The views (K/V row parts) of the draft head's layers (vLLM names them `mtp.layers.N`)."""
    return [v.name for v in sched.parts.layout.views if v.name.startswith("mtp.")]


def test_links_record_the_mtp_route_and_carry_the_draft_rows(llm):
    sched, _ = engine_parts(llm)
    assert sched.base_domain["route"] == "mtp"
    assert sched.anchors.max_count == 0              # end anchors are off with drafts
    assert _draft_views(sched), sched.parts.layout.views


def test_mtp_warm_equals_cold_and_the_reference(llm, reference):
    # B2: B with A's last token (as every chat prompt ends in the same generation prompt)
    b2 = B[:-1] + A[-1:]
    colds = {}
    for name, p in (("A", A), ("B", B), ("B2", b2)):
        clear(llm)
        colds[name] = run(llm, p)
    clear(llm)
    sched, _ = engine_parts(llm)
    shortened = sched.tree.stats().shortened
    run(llm, A)
    warms = {"B": run(llm, B), "B2": run(llm, b2), "A": run(llm, A)}
    # B2 leaves A at 2 * GRID: A's link there has a draft row made from A's next token, so B2
    # resumes one link earlier; B ends in another token than A, which every A link's draft
    # rows read, so it resumes nowhere; A resumes at its deepest cut
    assert {k: w["cached"] for k, w in warms.items()} == {"B": 0, "B2": GRID, "A": 3 * GRID}
    assert sched.tree.stats().shortened == shortened + 2
    for name, warm in warms.items():
        cold = colds[name]
        assert warm["tokens"] == cold["tokens"], name
        assert warm["logprobs"] == cold["logprobs"], name
        assert warm["state"] == cold["state"], name      # the draft head's rows included
    assert [warms["A"]["tokens"], warms["B"]["tokens"]] == reference


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
