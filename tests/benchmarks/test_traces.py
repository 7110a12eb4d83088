"""The trace generator: reproducible, the promised structure per family, sizes that scale."""

from __future__ import annotations

import json

import msgspec
import pytest

from benchmarks.ideal import PromptTokenizer, scripted_profile
from benchmarks.traces import FAMILIES, SIZES, Trace, generate


@pytest.fixture(scope="module")
def tokenizer(embedded_model) -> PromptTokenizer:
    return PromptTokenizer(embedded_model("qwen3-next-tiny"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_same_seed_same_trace_other_seed_other_trace(family: str) -> None:
    a = msgspec.json.encode(generate(family, "ci", 0))
    assert a == msgspec.json.encode(generate(family, "ci", 0))
    assert a != msgspec.json.encode(generate(family, "ci", 1))
    assert generate(family, "ci", 0).digest() == generate(family, "ci", 0).digest()


def test_unknown_names_fail_clearly() -> None:
    with pytest.raises(KeyError, match="known"):
        generate("no-such-family")
    with pytest.raises(KeyError, match="known"):
        generate("chat-ui", "huge")


def _check_common(trace: Trace) -> None:
    """Invariants every family keeps (the replayer relies on them)."""
    waves = [r.wave for r in trace.requests]
    assert waves == sorted(waves)
    assert set(waves) == set(range(len(set(waves)))), "waves are numbered 0..n-1"
    last: dict[str, int] = {}
    for req in trace.requests:
        msgs = trace.messages(req)
        assert msgs[0]["role"] == "system"
        assert msgs[-1]["role"] in ("user", "tool")
        assert trace.answer(req)["role"] == "assistant"
        assert req.n_messages > last.get(req.session, 0), "history only grows"
        last[req.session] = req.n_messages
    for session in trace.sessions.values():
        open_calls: set[str] = set()
        for msg in session.messages:
            for call in msg.get("tool_calls") or []:
                json.loads(call["function"]["arguments"])
                assert call["function"]["name"] in {
                    t["function"]["name"] for t in session.tools or []}
                open_calls.add(call["id"])
            if msg["role"] == "tool":
                assert msg["tool_call_id"] in open_calls, "a result answers an earlier call"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("size", ["ci", "small"])
def test_common_invariants(family: str, size: str) -> None:
    _check_common(generate(family, size, 3))


def test_coding_agent_shares_a_long_head_and_is_tool_heavy() -> None:
    trace = generate("coding-agent", "ci")
    sessions = list(trace.sessions.values())
    assert len(sessions) == SIZES["ci"].sessions >= 2
    assert all(s.tools == sessions[0].tools and s.tools for s in sessions)
    assert all(s.messages[0] == sessions[0].messages[0] for s in sessions)
    for s in sessions:
        roles = [m["role"] for m in s.messages]
        assert roles.count("tool") >= roles.count("user")
    assert [len(w) for w in trace.waves()] == [1] * len(trace.requests)


def test_chat_ui_short_head_no_tools_reasoning_dropped(tokenizer: PromptTokenizer) -> None:
    trace = generate("chat-ui", "ci")
    for s in trace.sessions.values():
        assert s.tools is None
        assert len(s.messages[0]["content"]) < 400
        assert any(m.get("reasoning") for m in s.messages if m["role"] == "assistant")
    req = next(r for r in trace.requests if r.turn == 2)
    earlier = trace.messages(req)[2]
    assert earlier["role"] == "assistant" and earlier["reasoning"]
    prompt = tokenizer.render(trace.messages(req), None)
    assert earlier["content"][:200] in prompt
    assert earlier["reasoning"][:200] not in prompt, "the template drops earlier reasoning"


def test_sub_agents_share_the_head_and_run_concurrently() -> None:
    trace = generate("sub-agents", "ci")
    parent = trace.sessions["parent"]
    subs = [s for name, s in trace.sessions.items() if name.startswith("sub")]
    assert len(subs) == SIZES["ci"].subagents
    for s in subs:
        assert s.tools == parent.tools and s.messages[0] == parent.messages[0]
    assert max(len(w) for w in trace.waves()) == len(subs)
    reports = {m["content"] for m in parent.messages if m["role"] == "tool"}
    assert all(s.messages[-1]["content"] in reports for s in subs)
    # the parent resumes only after every sub-agent finished
    last_sub_wave = max(r.wave for r in trace.requests if r.session != "parent")
    resumed = [r for r in trace.requests if r.session == "parent" and r.wave > last_sub_wave]
    assert resumed


def test_interleaved_sessions_take_turns() -> None:
    trace = generate("interleaved", "ci")
    order = [r.session for r in trace.requests]
    assert order[0] != order[1] and order[2] == order[0], "A, B, A"
    kinds = {name: s.tools is not None for name, s in trace.sessions.items()}
    assert set(kinds.values()) == {True, False}, "an agent and a chat session"


def test_concurrent_sessions_send_together() -> None:
    trace = generate("concurrent", "ci")
    n = SIZES["ci"].concurrent
    first = trace.waves()[0]
    assert len(first) == n and len({r.session for r in first}) == n


@pytest.mark.parametrize("family", list(FAMILIES))
def test_token_counts_scale_with_size(family: str, tokenizer: PromptTokenizer) -> None:
    totals, longest = [], []
    for size in ("ci", "small", "medium", "long"):
        prompts, ideal = scripted_profile(generate(family, size), tokenizer)
        assert all(0 <= i <= p - 1 for i, p in zip(ideal, prompts, strict=True))
        totals.append(sum(prompts))
        longest.append(max(prompts))
        assert max(prompts) < SIZES[size].max_model_len - 256, "fits the server's context"
    assert totals == sorted(totals) and longest == sorted(longest)
    assert longest[-1] >= 2 * longest[1]
    if family in ("coding-agent", "sub-agents", "concurrent"):
        assert longest[-1] >= 32_000, "long means 32K-token conversations"
    assert longest[0] <= 6_000, "ci stays small"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_growing_history_and_reasoning_re_rendering(family: str,
                                                    tokenizer: PromptTokenizer) -> None:
    """A tool turn extends the previous prompt token for token, so its ideal is at least that
    prompt. A user follow-up in an agent loop does not: the Qwen3 template drops the reasoning
    of every assistant turn before the last user query, so the turns of the loop re-render and
    the prefix breaks where the loop began. Chat turns extend, as their earlier reasoning was
    already dropped. This is the re-rendering the benchmark must expose, not hide."""
    trace = generate(family, "ci")
    prompts, ideal = scripted_profile(trace, tokenizer)
    previous: dict[str, int] = {}
    broke = 0
    for i, req in enumerate(trace.requests):
        if req.session in previous:
            last = trace.messages(req)[-1]["role"]
            p = prompts[previous[req.session]]
            if last == "tool" or trace.tools(req) is None:
                assert ideal[i] >= p
            else:
                assert ideal[i] < p
                broke += 1
        previous[req.session] = i
    if family == "coding-agent":
        assert broke >= 1, "the ci trace has a user follow-up after a tool loop"
