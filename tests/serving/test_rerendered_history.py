"""Re-rendered history through the OpenAI API: reasoning dropped, tool calls re-serialised.

An agent resends its history every turn, but the chat template does not render it the same way
each time: reasoning is kept only for assistant turns after the last user message (Qwen3 style),
so once the user speaks again every earlier answer loses its `<think>` text, and tool calls are
re-serialised from the client's JSON. The engine's earlier prompts then part from the new one in
the middle. Each turn must resume at the deepest cut before that point (a message end or a grid
line) and never past it, and a resumed turn must equal a cold run of the same messages.
"""

from __future__ import annotations

import json

import pytest

from demo.conversation import FILE_TEXT, SYSTEM_PROMPT
from tests.serving.conftest import (
    cached_tokens,
    chat_body,
    clear_cache,
    expected_hit,
    segmentation,
)

pytestmark = pytest.mark.slow

REASONING = [
    "The user wants logging in every handler. I should read app/handlers.py first, because the "
    "rules say never to guess a file's content, and then look for every caller of dispatch.",
    "All 24 handlers return dispatch(request, kind=i). Before editing I want the callers, so "
    "search for dispatch( across the repository and check nothing else wraps it.",
    "Only the handlers call dispatch, so a one-line logging call per handler is enough. The "
    "tests passed before; summarise and offer the follow-up test the user may want.",
    "The user asks for a test of handler_3's log line: use caplog, call handler_3 with a dummy "
    "request and assert the message names kind 3.",
]


def _call(i: int, name: str, args: dict) -> dict:
    # arguments as the client re-serialises them (its own JSON spacing), not as generated
    return {"role": "assistant", "content": "", "reasoning": REASONING[i],
            "tool_calls": [{"id": f"call_{i}", "type": "function",
                            "function": {"name": name,
                                         "arguments": json.dumps(args, indent=1)}}]}


def turns() -> list[list[dict]]:
    """Six requests of one session: two tool rounds (reasoning kept), a final answer, a new
    user message (every earlier reasoning dropped), then one more tool round and question."""
    h: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT},
                     {"role": "user", "content": "Add logging to every request handler in "
                      "app/handlers.py, then make sure the tests still pass."}]
    out = [list(h)]
    h += [_call(0, "read_file", {"path": "app/handlers.py"}),
          {"role": "tool", "tool_call_id": "call_0", "content": FILE_TEXT}]
    out.append(list(h))
    h += [_call(1, "search_code", {"pattern": "dispatch\\("}),
          {"role": "tool", "tool_call_id": "call_1",
           "content": "\n".join(f"app/handlers.py:{3 + 4 * i}: return dispatch(request, "
                                f"kind={i})" for i in range(24))}]
    out.append(list(h))
    h += [{"role": "assistant", "reasoning": REASONING[2],
           "content": "Done: every handler logs its kind and the 24 tests pass."},
          {"role": "user", "content": "Thanks. Can you also add a test that checks the log "
           "line of handler_3?"}]
    out.append(list(h))
    h += [_call(3, "read_file", {"path": "tests/test_handlers.py"}),
          {"role": "tool", "tool_call_id": "call_3",
           "content": "import app.handlers\n\n" + FILE_TEXT[:600]}]
    out.append(list(h))
    h += [{"role": "assistant", "content": "Added test_handler_3_logs_its_kind; it passes."},
          {"role": "user", "content": "Great, please summarise the whole change."}]
    out.append(list(h))
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_rerendered_turns_resume_at_the_deepest_cut_before_the_divergence(server):
    seg = segmentation(server)
    clear_cache(server)
    seen: list[list[int]] = []
    diverged = []
    for i, messages in enumerate(turns()):
        body = chat_body(server, messages)
        ids, cached = body["prompt_token_ids"], cached_tokens(body)
        if seen:
            # how far the engine's previous prompt survives in this one
            shared = max(_common(ids, e) for e in seen)
            if shared < len(seen[-1]):
                diverged.append(i)
            assert cached <= shared
        assert cached == expected_hit(seg, ids, seen), (i, len(ids), cached)
        seen.append(ids)
    # the first user-turn boundary drops the reasoning of three earlier answers (turn 3), the
    # second drops the reasoning of the tool round after it (turn 5); both still hit
    assert diverged == [3, 5]
    prompts = [len(s) for s in seen]
    assert all(0 < expected_hit(seg, seen[i], seen[:i]) < prompts[i - 1] for i in diverged)


def test_resumed_rerendered_turn_equals_a_cold_run(server):
    """The turn where reasoning was dropped, resumed at its cut, against the same messages
    prefilled cold (cache cleared): same tokens, same logprobs."""
    history = turns()
    clear_cache(server)
    for messages in history[:3]:
        chat_body(server, messages)
    extra = {"logprobs": True, "top_logprobs": 3}
    warm = chat_body(server, history[3], **extra)
    clear_cache(server)
    cold = chat_body(server, history[3], **extra)
    assert cached_tokens(warm) > 0 and cached_tokens(cold) == 0
    w, c = warm["choices"][0], cold["choices"][0]
    assert w["token_ids"] == c["token_ids"]
    assert w["logprobs"]["content"] == c["logprobs"]["content"]
