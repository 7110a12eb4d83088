"""The scripted agent sessions of the demo: what a coding agent sends, turn by turn.

The model has random weights, so its answers are noise; like any agent client, the demo keeps
its own history (scripted assistant tool calls and tool results) and resends it every turn.
That resent history is exactly what the snapshot cache is for.
"""

from __future__ import annotations

import json

SYSTEM_PROMPT = "\n\n".join([
    "You are Forge, a careful software engineering agent working inside a user's repository. "
    "You read code before you change it, you run the tests before and after every change, and "
    "you explain what you did in a short summary at the end of the task.",
    "Working rules:\n" + "\n".join(
        f"{i}. " + rule for i, rule in enumerate([
            "Never guess a file's content: read it with the read_file tool first.",
            "Prefer small, reviewable edits; one concern per edit.",
            "Run the test suite with run_tests after each edit and read the failures in full.",
            "Use search_code to find every caller before renaming or removing a function.",
            "Keep public interfaces stable unless the task asks to change them.",
            "When a command fails, report the exact error and what you will try next.",
            "Do not install packages or reach the network unless the user asks you to.",
            "Write docstrings that say why the code exists, not what each line does.",
            "Stop and ask when the task is ambiguous instead of inventing requirements.",
            "Summarise the change, the tests run and anything left undone at the end.",
        ], start=1)),
    "Repository conventions: Python 3.11, type hints throughout, ruff for lint, pytest for "
    "tests, msgspec structs for configuration, small modules with one job each. Tests live "
    "next to the package in tests/, benchmarks in benchmarks/, documentation in docs/.",
    "Output format: think step by step inside <think></think>, then either call exactly one "
    "tool with a <tool_call> block, or answer the user. Keep answers under 200 words.",
])

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path relative to the repository root"},
            "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string"}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace an exact snippet of a file with new text.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run pytest with optional arguments.",
        "parameters": {"type": "object", "properties": {"args": {"type": "string"}}}}},
]

FILE_TEXT = "\n".join(
    f"def handler_{i}(request):\n    \"\"\"Handle request kind {i}.\"\"\"\n"
    f"    return dispatch(request, kind={i})\n" for i in range(24))


def _call(call_id: str, name: str, args: dict) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)}}]}


def _result(call_id: str, text: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def session(task: str, steps: list[tuple[str, dict, str]], follow_up: str | None) -> list[list]:
    """The message list sent at each turn of one session (each turn resends the history)."""
    history = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}]
    turns = [list(history)]
    for i, (name, args, result) in enumerate(steps):
        history += [_call(f"call_{i}", name, args), _result(f"call_{i}", result)]
        turns.append(list(history))
    if follow_up:
        history += [{"role": "assistant", "content": "Done: the handlers now log their kind."},
                    {"role": "user", "content": follow_up}]
        turns.append(list(history))
    return turns


def demo_sessions() -> list[tuple[str, list[list]]]:
    main = session(
        "Add logging to every request handler in app/handlers.py, then make sure the tests "
        "still pass.",
        [("read_file", {"path": "app/handlers.py"}, FILE_TEXT),
         ("search_code", {"pattern": "dispatch\\("},
          "\n".join(f"app/handlers.py:{3 + 4 * i}: return dispatch(request, kind={i})"
                    for i in range(24))),
         ("run_tests", {"args": "-q tests/test_handlers.py"},
          "........................ [100%]\n24 passed in 0.41s")],
        "Thanks. Can you also add a test that checks the log line of handler_3?",
    )
    sub_agent = session(
        "Sub-task from the lead agent: list every module that imports app.handlers.",
        [("search_code", {"pattern": "import app.handlers|from app.handlers"},
          "app/server.py:3: from app.handlers import handler_0\n"
          "app/cli.py:7: import app.handlers")],
        None,
    )
    return [("session A (lead agent)", main), ("session B (sub-agent, same system prompt)",
                                              sub_agent)]
