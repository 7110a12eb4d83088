"""Prompt tokens as the server sees them, and the ideal cached prefix of each request.

The ideal is what a perfect prefix cache could have served: for request i, the longest token
prefix that its prompt shares with anything the server had already processed before i was sent,
that is the prompt followed by the generated answer of every request of an earlier wave. It is
capped at `prompt_tokens - 1` because the last prompt token must always be computed to get the
logits of the first new token (vLLM caps its own hits the same way). Requests of the same wave
run at the same time, so they never count for each other.

Prompts are rendered here with the model's own tokenizer and chat template, exactly as vLLM's
OpenAI server renders them: assistant `reasoning` becomes the template's `reasoning_content`, and
tool-call arguments (JSON strings on the wire) become dicts, as vLLM does before templating. The
replayer checks this against the token ids the server returns (`return_token_ids`), so a
template drift shows up as `prompt_mismatches` in the report instead of a silently wrong ideal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.traces.model import Message, Trace


def to_template(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """OpenAI wire messages -> the dicts vLLM hands to the chat template."""
    out = []
    for msg in messages:
        m = dict(msg)
        if "reasoning" in m:
            m["reasoning_content"] = m.pop("reasoning")
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call["function"])
                if isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"] else {}
                calls.append({**call, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


class PromptTokenizer:
    """The model's tokenizer + chat template, rendering prompts the way the server does."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_path))

    def render(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(to_template(messages), tools=tools or None,
                                            add_generation_prompt=add_generation_prompt,
                                            tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: Sequence[Message],
                   tools: list[dict[str, Any]] | None) -> list[int]:
        return self.encode(self.render(messages, tools))

    def scripted_seen_ids(self, messages: Sequence[Message], answer: Message,
                          tools: list[dict[str, Any]] | None) -> list[int]:
        """Prompt plus the scripted answer, as a model that wrote that answer would hold it."""
        return self.encode(self.render([*messages, answer], tools, add_generation_prompt=False))


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def ideal_cached(waves: Sequence[int], prompts: Sequence[Sequence[int]],
                 seen: Sequence[Sequence[int]]) -> list[int]:
    """Per request: longest prefix shared with `seen[j]` of any request j in an earlier wave.

    `seen[j]` is what the server processed for request j (prompt + generated tokens). The result
    is capped at len(prompt) - 1 (see the module docstring).
    """
    if not (len(waves) == len(prompts) == len(seen)):
        raise ValueError("waves, prompts and seen must have one entry per request")
    arrays = [np.asarray(s, dtype=np.int64) for s in seen]
    out = []
    for i, prompt in enumerate(prompts):
        p = np.asarray(prompt, dtype=np.int64)
        best = 0
        for j in range(len(prompts)):
            if waves[j] < waves[i]:
                best = max(best, common_prefix(p, arrays[j]))
        out.append(min(best, max(0, len(p) - 1)))
    return out


def scripted_profile(trace: Trace, tokenizer: PromptTokenizer) -> tuple[list[int], list[int]]:
    """(prompt tokens, ideal cached tokens) per request, if the model had written the script.

    This is the trace's own property, independent of any server: the replayer measures the
    ideal against what the server really generated instead (see `ideal_cached`).
    """
    prompts = [tokenizer.prompt_ids(trace.messages(r), trace.tools(r)) for r in trace.requests]
    seen = [tokenizer.scripted_seen_ids(trace.messages(r), trace.answer(r), trace.tools(r))
            for r in trace.requests]
    ideal = ideal_cached([r.wave for r in trace.requests], prompts, seen)
    return [len(p) for p in prompts], ideal
