"""The trace families: how agents and chat UIs actually grow their prompts.

- coding-agent: a long shared head (system rules + tool definitions), then tool-heavy turns:
  reasoning, a tool call, a large tool result, again; now and then a user follow-up. Several
  sessions one after another share the head (a team using one agent on one server).
- chat-ui: a short system prompt, no tools, user questions (sometimes a pasted document) and
  answers with reasoning. The chat template drops reasoning from turns before the last user
  query, so the history the client sends never equals what the model generated.
- sub-agents: a parent agent spawns sub-agents that share its head, runs them concurrently
  (one wave per sub-agent step), and continues with their reports as tool results.
- interleaved: sessions used in turn (A, B, A, B, ...): a coding agent and a chat UI on one
  server, so each one's state must survive the other's requests.
- concurrent: several coding sessions on the shared head, one request of each per wave.
- image-chat: screenshots (PNG data URLs) and follow-up questions about them, for
  vision-language models (`image_chat.py`).

Every session draws from its own `random.Random` seeded with a string of (seed, family,
session), so adding a session never changes the others and a trace is reproducible anywhere.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from benchmarks.traces import text
from benchmarks.traces.image_chat import image_chat
from benchmarks.traces.model import Message, Request, Session, Trace
from benchmarks.traces.sizes import SIZES, Size

# name, what it does, parameters (name -> (type, doc)), which result generator it uses
_TOOL_SPECS: tuple[tuple[str, str, dict[str, tuple[str, str]], str], ...] = (
    ("read_file", "Read a file of the repository and return its text with line numbers.",
     {"path": ("string", "Path relative to the repository root."),
      "offset": ("integer", "First line to return."),
      "limit": ("integer", "Number of lines to return.")}, "source"),
    ("write_file", "Create or overwrite a file with the given content.",
     {"path": ("string", "Path relative to the repository root."),
      "content": ("string", "The whole new content.")}, "short"),
    ("edit_file", "Replace one exact occurrence of a string in a file.",
     {"path": ("string", "File to edit."), "old": ("string", "Text to replace."),
      "new": ("string", "Replacement text.")}, "short"),
    ("list_dir", "List the files below a directory.",
     {"path": ("string", "Directory to list."),
      "depth": ("integer", "How many levels to descend.")}, "shell"),
    ("grep", "Search the repository for a regular expression.",
     {"pattern": ("string", "Regular expression."),
      "path": ("string", "Directory or file to search.")}, "grep"),
    ("run_tests", "Run the test suite or a subset of it and return the log.",
     {"selector": ("string", "pytest node id or keyword expression.")}, "tests"),
    ("run_shell", "Run a shell command in the repository and return its output.",
     {"command": ("string", "The command line."),
      "timeout": ("integer", "Seconds before the command is killed.")}, "shell"),
    ("git_diff", "Show the uncommitted changes.",
     {"path": ("string", "Limit the diff to this path.")}, "source"),
    ("web_search", "Search the web and return titles, links and snippets.",
     {"query": ("string", "Search terms."),
      "count": ("integer", "Number of results.")}, "json"),
    ("todo_write", "Replace the task list shown to the user.",
     {"items": ("string", "One task per line.")}, "short"),
    ("spawn_agent", "Start a sub-agent on a self-contained task and return its final report.",
     {"task": ("string", "What the sub-agent must do."),
      "context": ("string", "Files and facts it needs.")}, "report"),
)

_RESULT_SCALE = {"source": 1.5, "grep": 0.6, "tests": 0.9, "shell": 0.4, "json": 0.8,
                 "short": 0.05, "report": 0.5}


def _tools(rng: random.Random, doc_tokens: int) -> list[dict[str, Any]]:
    """OpenAI tool definitions; descriptions padded so the head reaches its size."""
    per_tool = max(0, doc_tokens // len(_TOOL_SPECS))
    tools = []
    for name, doc, params, _ in _TOOL_SPECS:
        description = doc if per_tool < 20 else doc + " " + text.prose(rng, per_tool)
        tools.append({
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {p: {"type": t, "description": d}
                                   for p, (t, d) in params.items()},
                    "required": [next(iter(params))],
                },
            },
        })
    return tools


def _tokens(obj: Any) -> float:
    """Approximate tokens of a message or tool list, from the characters of its JSON."""
    return len(json.dumps(obj)) / text.CHARS_PER_TOKEN["message"]


def _agent_head(seed: int, family: str, size: Size) -> tuple[str, list[dict[str, Any]]]:
    """The shared head of agent sessions: system rules plus tool definitions."""
    rng = random.Random(f"{seed}/{family}/head")
    # Half the head is tool definitions (padded descriptions), half system text, as in coding
    # agents whose heads run from a few thousand to tens of thousands of tokens.
    bare = int(_tokens(_tools(random.Random(0), 0)))
    tools = _tools(rng, max(0, size.head_tokens // 2 - bare))
    system_tokens = max(50, size.head_tokens - int(_tokens(tools)))
    system = ("You are a coding agent working in the user's repository. Use the tools to read, "
              "search, edit and test code.\n\n" + text.bullet_rules(rng, system_tokens))
    return system, tools


def _tool_result(rng: random.Random, kind: str, size: Size) -> str:
    tokens = max(10, int(size.tool_result_tokens * _RESULT_SCALE[kind] * rng.uniform(0.5, 1.5)))
    if kind == "source":
        return text.source_file(rng, tokens)
    if kind == "grep":
        return text.grep_hits(rng, tokens)
    if kind == "tests":
        return text.test_log(rng, tokens)
    if kind == "shell":
        return text.shell_output(rng, tokens)
    if kind == "json":
        return text.json_records(rng, tokens)
    if kind == "report":
        return text.prose(rng, tokens)
    return "OK: " + text.sentence(rng, 3, 8)


def _tool_args(rng: random.Random, name: str) -> dict[str, Any]:
    spec = next(s for s in _TOOL_SPECS if s[0] == name)
    args: dict[str, Any] = {}
    for p, (t, _) in spec[2].items():
        if t == "integer":
            args[p] = rng.randint(1, 400)
        elif p == "path":
            args[p] = text.path(rng)
        elif p == "command":
            args[p] = f"make {text.identifier(rng)}"
        else:
            args[p] = text.sentence(rng, 3, 10)
    return args


class _Conversation:
    """One session being written: messages plus the indices where a request is sent."""

    def __init__(self, sid: str, tools: list[dict[str, Any]] | None, system: str) -> None:
        self.sid = sid
        self.tools = tools
        self.messages: list[Message] = [{"role": "system", "content": system}]
        self.request_at: list[int] = []
        self.tokens = _tokens(system) + (_tokens(tools) if tools else 0.0)
        self._calls = 0

    def add(self, msg: Message) -> None:
        self.messages.append(msg)
        self.tokens += _tokens(msg)

    def ask(self) -> None:
        """A request is sent here: the next message will be the model's answer."""
        self.request_at.append(len(self.messages))

    def call_id(self) -> str:
        self._calls += 1
        return f"call_{self.sid}_{self._calls}"

    def session(self) -> Session:
        return Session(id=self.sid, tools=self.tools, messages=self.messages)


def _agent_step(conv: _Conversation, rng: random.Random, size: Size,
                tool_names: list[str]) -> None:
    """Assistant reasoning + one or two tool calls, then their results; ends with a request."""
    calls = []
    for _ in range(1 if rng.random() < 0.8 else 2):
        name = rng.choice(tool_names)
        calls.append({"id": conv.call_id(), "type": "function",
                      "function": {"name": name,
                                   "arguments": json.dumps(_tool_args(rng, name))}})
    content = text.sentence(rng) if rng.random() < 0.3 else ""
    conv.add({"role": "assistant", "content": content,
              "reasoning": text.prose(rng, size.reasoning_tokens), "tool_calls": calls})
    for call in calls:
        kind = next(s[3] for s in _TOOL_SPECS if s[0] == call["function"]["name"])
        conv.add({"role": "tool", "tool_call_id": call["id"],
                  "content": _tool_result(rng, kind, size)})
    conv.ask()


def _final_answer(conv: _Conversation, rng: random.Random, size: Size) -> None:
    conv.add({"role": "assistant", "content": text.prose(rng, size.answer_tokens),
              "reasoning": text.prose(rng, size.reasoning_tokens)})


_WORK_TOOLS = ["read_file", "grep", "run_tests", "run_shell", "list_dir", "edit_file",
               "git_diff", "web_search", "write_file", "todo_write"]


def _coding_session(sid: str, rng: random.Random, size: Size, system: str,
                    tools: list[dict[str, Any]], target: int) -> _Conversation:
    """User task, tool steps until the prompt reaches `target` tokens, follow-ups on the way."""
    conv = _Conversation(sid, tools, system)
    conv.add({"role": "user", "content": text.prose(rng, size.user_tokens)})
    conv.ask()
    steps = 0
    while conv.tokens < target:
        _agent_step(conv, rng, size, _WORK_TOOLS)
        steps += 1
        if steps % 5 == 0 and conv.tokens < target:
            _final_answer(conv, rng, size)
            conv.add({"role": "user", "content": text.prose(rng, size.user_tokens)})
            conv.ask()
    _final_answer(conv, rng, size)
    return conv


def _chat_session(sid: str, rng: random.Random, size: Size, target: int) -> _Conversation:
    """Questions (a third paste a document) and answers with long reasoning."""
    system = "You are a helpful assistant. Answer concisely and cite the user's text.\n" + \
        text.sentence(rng)
    conv = _Conversation(sid, None, system)
    while True:
        question = text.prose(rng, size.user_tokens)
        if rng.random() < 0.35:
            question += "\n\n```\n" + text.prose(rng, 4 * size.user_tokens) + "\n```"
        conv.add({"role": "user", "content": question})
        conv.ask()
        conv.add({"role": "assistant", "content": text.prose(rng, 2 * size.answer_tokens),
                  "reasoning": text.prose(rng, 3 * size.reasoning_tokens)})
        if conv.tokens >= target:
            return conv


def _session_rng(seed: int, family: str, sid: str) -> random.Random:
    return random.Random(f"{seed}/{family}/{sid}")


def _sequential(convs: list[_Conversation]) -> list[Request]:
    """Each session to its end, then the next; one request per wave."""
    reqs: list[Request] = []
    for conv in convs:
        for turn, n in enumerate(conv.request_at):
            reqs.append(Request(conv.sid, turn, len(reqs), n))
    return reqs


def _lockstep(convs: list[_Conversation], first_wave: int = 0) -> list[Request]:
    """Turn k of every session in wave k (sent together)."""
    reqs: list[Request] = []
    for turn in range(max(len(c.request_at) for c in convs)):
        for conv in convs:
            if turn < len(conv.request_at):
                reqs.append(Request(conv.sid, turn, first_wave + turn, conv.request_at[turn]))
    return reqs


def coding_agent(seed: int, size: Size) -> tuple[list[_Conversation], list[Request]]:
    system, tools = _agent_head(seed, "coding-agent", size)
    convs = [_coding_session(f"agent{i}", _session_rng(seed, "coding-agent", f"agent{i}"), size,
                             system, tools, size.conversation_tokens)
             for i in range(size.sessions)]
    return convs, _sequential(convs)


def chat_ui(seed: int, size: Size) -> tuple[list[_Conversation], list[Request]]:
    convs = [_chat_session(f"chat{i}", _session_rng(seed, "chat-ui", f"chat{i}"), size,
                           size.conversation_tokens)
             for i in range(size.sessions)]
    return convs, _sequential(convs)


def interleaved(seed: int, size: Size) -> tuple[list[_Conversation], list[Request]]:
    system, tools = _agent_head(seed, "interleaved", size)
    convs: list[_Conversation] = []
    for i in range(max(2, size.sessions)):
        rng = _session_rng(seed, "interleaved", f"s{i}")
        if i % 2 == 0:
            convs.append(_coding_session(f"s{i}", rng, size, system, tools,
                                         size.conversation_tokens))
        else:
            convs.append(_chat_session(f"s{i}", rng, size, size.conversation_tokens))
    reqs: list[Request] = []
    for turn in range(max(len(c.request_at) for c in convs)):
        for conv in convs:
            if turn < len(conv.request_at):
                reqs.append(Request(conv.sid, turn, len(reqs), conv.request_at[turn]))
    return convs, reqs


def concurrent(seed: int, size: Size) -> tuple[list[_Conversation], list[Request]]:
    system, tools = _agent_head(seed, "concurrent", size)
    convs = [_coding_session(f"c{i}", _session_rng(seed, "concurrent", f"c{i}"), size,
                             system, tools, size.conversation_tokens)
             for i in range(size.concurrent)]
    return convs, _lockstep(convs)


def sub_agents(seed: int, size: Size) -> tuple[list[_Conversation], list[Request]]:
    """Parent: task, two steps, spawn K sub-agents; they run in lockstep; parent resumes."""
    system, tools = _agent_head(seed, "sub-agents", size)
    rng = _session_rng(seed, "sub-agents", "parent")
    parent = _Conversation("parent", tools, system)
    parent.add({"role": "user", "content": text.prose(rng, size.user_tokens)})
    parent.ask()
    for _ in range(2):
        _agent_step(parent, rng, size, _WORK_TOOLS)
    calls = [{"id": parent.call_id(), "type": "function",
              "function": {"name": "spawn_agent",
                           "arguments": json.dumps(_tool_args(rng, "spawn_agent"))}}
             for _ in range(size.subagents)]
    parent.add({"role": "assistant", "content": "",
                "reasoning": text.prose(rng, size.reasoning_tokens), "tool_calls": calls})
    subs: list[_Conversation] = []
    for i, call in enumerate(calls):
        sub_rng = _session_rng(seed, "sub-agents", f"sub{i}")
        sub = _Conversation(f"sub{i}", tools, system)
        sub.add({"role": "user", "content": json.loads(call["function"]["arguments"])["task"]
                 + "\n\n" + text.prose(sub_rng, size.user_tokens)})
        sub.ask()
        while sub.tokens < size.conversation_tokens // 2:
            _agent_step(sub, sub_rng, size, [t for t in _WORK_TOOLS if t != "todo_write"])
        _final_answer(sub, sub_rng, size)
        subs.append(sub)
        parent.add({"role": "tool", "tool_call_id": call["id"],
                    "content": sub.messages[-1]["content"]})
    parent.ask()
    before = len(parent.request_at)
    while parent.tokens < size.conversation_tokens:
        _agent_step(parent, rng, size, _WORK_TOOLS)
    _final_answer(parent, rng, size)

    reqs: list[Request] = []
    spawn = parent.request_at[: before - 1]
    for turn, n in enumerate(spawn):
        reqs.append(Request("parent", turn, len(reqs), n))
    first = len(reqs)
    sub_reqs = _lockstep(subs, first_wave=first)
    reqs.extend(sub_reqs)
    wave = max(r.wave for r in sub_reqs) + 1
    for turn in range(len(spawn), len(parent.request_at)):
        reqs.append(Request("parent", turn, wave, parent.request_at[turn]))
        wave += 1
    return [parent, *subs], reqs


FAMILIES: dict[str, tuple[Callable[[int, Size], tuple[list[_Conversation], list[Request]]],
                          str]] = {
    "coding-agent": (coding_agent, "sessions in sequence on a shared system+tools head, "
                                   "tool-heavy turns"),
    "chat-ui": (chat_ui, "short system prompt, no tools, reasoning dropped from earlier turns"),
    "sub-agents": (sub_agents, "a parent agent and concurrent sub-agents sharing its head"),
    "interleaved": (interleaved, "a coding agent and a chat session used in turn (A, B, A)"),
    "concurrent": (concurrent, "coding sessions on a shared head, one request each per wave"),
    "image-chat": (image_chat, "screenshots and follow-up questions, sessions in sequence "
                               "(vision-language models)"),
}
# Families whose requests carry images: only a vision-language model serves them, so "all" (the
# default of the runners, the soak) means the text families and these are named explicitly.
IMAGE_FAMILIES = ("image-chat",)
TEXT_FAMILIES = tuple(f for f in FAMILIES if f not in IMAGE_FAMILIES)


def generate(family: str, size: str = "ci", seed: int = 0) -> Trace:
    """The trace of `family` at `size`; the same arguments give the same trace, byte for byte."""
    if family not in FAMILIES:
        raise KeyError(f"unknown trace family {family!r}; known: {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise KeyError(f"unknown trace size {size!r}; known: {', '.join(SIZES)}")
    build, description = FAMILIES[family]
    convs, reqs = build(seed, SIZES[size])
    return Trace(family=family, size=size, seed=seed, description=description,
                 sessions={c.sid: c.session() for c in convs}, requests=reqs)
