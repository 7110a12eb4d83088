"""What a trace is: sessions of OpenAI chat messages, and the order requests are sent in.

A trace is generated ahead of time (the embedded models have random weights and answer
gibberish), so every assistant turn, tool call and tool result is scripted. A request is "the
first `n_messages` messages of session S", and its scripted answer is message `n_messages` of
the same session (always an assistant message). Keeping sessions as one message list, rather
than a full copy per request, keeps 40K-token traces small in memory and makes the growing
history explicit.

Requests are grouped in *waves*: the replayer sends all requests of a wave at the same time and
waits for all of them before the next wave. Sequential families have one request per wave;
concurrent sessions and sub-agents put several in one wave. "Earlier" in the ideal-fraction
definition means "in an earlier wave": requests of the same wave run at the same time, so no
cache could reuse one for another.
"""

from __future__ import annotations

from typing import Any

import msgspec

Message = dict[str, Any]


class Session(msgspec.Struct, frozen=True):
    """One conversation: its tool definitions (None for plain chat) and all its messages."""

    id: str
    tools: list[dict[str, Any]] | None
    messages: list[Message]


class Request(msgspec.Struct, frozen=True):
    """One chat completion: the first `n_messages` messages of a session, sent in `wave`."""

    session: str
    turn: int
    wave: int
    n_messages: int


class Trace(msgspec.Struct, frozen=True):
    """A whole benchmark trace; `generate(family, size, seed)` makes the same one every time."""

    family: str
    size: str
    seed: int
    description: str
    sessions: dict[str, Session]
    requests: list[Request]

    def messages(self, req: Request) -> list[Message]:
        """The messages a request sends (its history, ending with a user or tool message)."""
        return self.sessions[req.session].messages[: req.n_messages]

    def answer(self, req: Request) -> Message:
        """The scripted assistant answer to a request (the next message of its session)."""
        return self.sessions[req.session].messages[req.n_messages]

    def tools(self, req: Request) -> list[dict[str, Any]] | None:
        return self.sessions[req.session].tools

    def waves(self) -> list[list[Request]]:
        """Requests grouped by wave, in order."""
        out: dict[int, list[Request]] = {}
        for req in self.requests:
            out.setdefault(req.wave, []).append(req)
        return [out[w] for w in sorted(out)]

    def digest(self) -> str:
        """A short hash of the whole trace, so a report names exactly what was replayed."""
        import hashlib

        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]
