"""Trace sizes, from one CI runs in a minute to 40K-token conversations.

All numbers are approximate tokens (see `text.CHARS_PER_TOKEN`). `conversation_tokens` is how
long each session's prompt grows before it ends; `head_tokens` is the shared system prompt plus
tool definitions of agent sessions. The per-message sizes grow with the trace so that a long
trace is long because its tool results and histories are, as in real agent sessions, rather
than because it has hundreds of tiny turns.
"""

from __future__ import annotations

import msgspec


class Size(msgspec.Struct, frozen=True):
    """How big a trace is; the generator reads nothing else."""

    name: str
    head_tokens: int
    conversation_tokens: int
    sessions: int
    concurrent: int
    subagents: int
    tool_result_tokens: int
    reasoning_tokens: int
    user_tokens: int
    answer_tokens: int
    max_model_len: int
    """Context length the servers need for this size (longest prompt plus answer, rounded up)."""


SIZES: dict[str, Size] = {
    s.name: s
    for s in (
        Size("ci", head_tokens=1500, conversation_tokens=4000, sessions=2, concurrent=2,
             subagents=2, tool_result_tokens=250, reasoning_tokens=40, user_tokens=50,
             answer_tokens=60, max_model_len=8192),
        Size("small", head_tokens=3000, conversation_tokens=8000, sessions=2, concurrent=3,
             subagents=3, tool_result_tokens=600, reasoning_tokens=80, user_tokens=100,
             answer_tokens=150, max_model_len=16384),
        Size("medium", head_tokens=6000, conversation_tokens=20000, sessions=2, concurrent=3,
             subagents=3, tool_result_tokens=1500, reasoning_tokens=150, user_tokens=200,
             answer_tokens=300, max_model_len=32768),
        Size("long", head_tokens=10000, conversation_tokens=40000, sessions=2, concurrent=3,
             subagents=3, tool_result_tokens=3000, reasoning_tokens=200, user_tokens=300,
             answer_tokens=400, max_model_len=65536),
    )
}
