"""`InflightLinks`: which links in flight a lookup waits for (vllm_hybridcache/adapter/inflight.py).

The harness tests (tests/harness/test_deferred_reports.py) run the wait on vLLM's scheduler;
these check the matching rules one by one: same domain, same tokens up to the link's cut, a cut
deeper than the answer and within the limit, a fitting draft tag, a link still pending, and
a report that is not overdue.
"""

from __future__ import annotations

from vllm_hybridcache.adapter.inflight import MAX_AGE, InflightLinks
from vllm_hybridcache.core import LinkAddr, PromptKeys

DOM = b"d" * 32
CAPTURER = PromptKeys(list(range(1, 101)))
ADDR = LinkAddr("ram", "tree", 7)


def flights(end: int = 64, tag: object = None) -> InflightLinks:
    f = InflightLinks()
    f.next_plan()
    f.planned(ADDR, DOM, CAPTURER, end, tag)
    f.next_plan()
    return f


def pending(_addr: LinkAddr) -> bool:
    return True


def test_a_deeper_pending_link_on_the_same_prefix_is_awaited():
    prompt = PromptKeys(list(range(1, 65)) + [999] * 20)
    assert flights().awaited(prompt, DOM, 0, len(prompt) - 1, pending)


def test_what_does_not_serve_the_prompt_is_not_awaited():
    prompt = PromptKeys(list(range(1, 65)) + [999] * 20)
    f = flights()
    assert not f.awaited(prompt, b"e" * 32, 0, 83, pending)           # another domain
    assert not f.awaited(prompt, DOM, 64, 83, pending)                # not deeper
    assert not f.awaited(prompt, DOM, 0, 63, pending)                 # past the limit
    other = PromptKeys([*range(1, 64), 5, *[999] * 20])               # parts at 63
    assert not f.awaited(other, DOM, 0, 83, pending)
    assert not f.awaited(PromptKeys(range(1, 40)), DOM, 0, 38, pending)  # shorter prompt
    assert not f.awaited(prompt, DOM, 0, 83, pending, fits=lambda p, tag: False)
    assert f.awaited(prompt, DOM, 0, 83, pending, fits=lambda p, tag: p == 64)


def test_reported_committed_or_overdue_links_are_forgotten():
    prompt = PromptKeys(list(range(1, 65)) + [999] * 20)
    f = flights()
    f.reported([ADDR])
    assert len(f) == 0 and not f.awaited(prompt, DOM, 0, 83, pending)
    f = flights()
    assert not f.awaited(prompt, DOM, 0, 83, lambda addr: False)      # committed or aborted
    assert len(f) == 0
    f = flights()
    for _ in range(MAX_AGE):
        f.next_plan()
    assert len(f) == 0 and not f.awaited(prompt, DOM, 0, 83, pending)
