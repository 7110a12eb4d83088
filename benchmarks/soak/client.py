"""One chat completion as the soak run sends it, and the cold run it is checked against.

Every request is greedy (`temperature` 0, `ignore_eos`, a fixed `max_tokens`), streamed (for
the time to the first token), and asks for its top logprobs spelled as token ids and for its
prompt's token ids (to tell a tree hit, which ends at a cut, from an end-anchor hit). The cold
run is the same body with a `cache_salt` nobody used before: a domain no link belongs to, so it
misses and prefills everything, in the same engine and under the same load.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec
import requests

from benchmarks.replay import sse_chunks
from benchmarks.soak.check import Generation, parse_completion_logprobs, parse_logprobs

TOP_LOGPROBS = 5


class Outcome(msgspec.Struct):
    """What one HTTP exchange gave back; `error` is None for a complete answer."""

    status: int | None = None
    error: str | None = None
    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    text: str = ""
    output_ids: list[int] = msgspec.field(default_factory=list)
    generation: Generation | None = None


def chat_body(model: str, messages: list[dict[str, Any]], tools: list | None, max_tokens: int,
              salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "seed": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": True,
        "top_logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True,
    }
    if tools:
        body["tools"] = tools
        body["tool_choice"] = "none"
    if salt is not None:
        body["cache_salt"] = salt
    return body


def tokens_body(model: str, prompt_ids: list[int], max_tokens: int,
                salt: str | None) -> dict[str, Any]:
    """A `/v1/completions` body on token ids: how a session continues exactly where the last
    answer stopped (the end anchor's position), which a chat template's re-rendering of
    random-weight gibberish rarely reproduces."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "seed": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def is_tokens_body(body: dict[str, Any]) -> bool:
    return "prompt" in body


def cold_salt() -> str:
    return f"cold-{uuid.uuid4().hex}"


def stream_chat(http: requests.Session, root: str, body: dict[str, Any],
                timeout: float) -> Outcome:
    """Send `body` streamed; collect tokens, logprobs, usage and the first token's time."""
    out = Outcome()
    content: list[dict] = []
    start = time.perf_counter()
    tokens = is_tokens_body(body)
    url = root + ("/v1/completions" if tokens else "/v1/chat/completions")
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    output_ids: list[int] = []
    top: list[dict] = []
    try:
        with http.post(url, json=body, stream=True, timeout=timeout) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            for chunk in sse_chunks(r):
                if "error" in chunk:
                    out.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    break
                if chunk.get("prompt_token_ids") is not None:
                    out.prompt_ids = list(chunk["prompt_token_ids"])
                for choice in chunk.get("choices") or []:
                    if tokens:
                        if choice.get("prompt_token_ids") is not None:
                            out.prompt_ids = list(choice["prompt_token_ids"])
                        lp = choice.get("logprobs") or {}
                        if lp.get("tokens") and out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - start
                        output_ids.extend(choice.get("token_ids") or [])
                        top.append(lp)
                        continue
                    entries = (choice.get("logprobs") or {}).get("content") or []
                    if entries and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - start
                    content.extend(entries)
                    out.text += str((choice.get("delta") or {}).get("content") or "")
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens")
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
    except (requests.RequestException, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
    out.e2e_s = time.perf_counter() - start
    if out.error is None:
        if out.prompt_tokens is None:
            out.error = "no usage in the stream"
        elif tokens:
            merged = {"tokens": [t for lp in top for t in lp.get("tokens") or []],
                      "token_logprobs": [x for lp in top for x in lp.get("token_logprobs") or []],
                      "top_logprobs": [x for lp in top for x in lp.get("top_logprobs") or []]}
            out.generation = parse_completion_logprobs(merged)
            out.output_ids = output_ids
        else:
            out.generation = parse_logprobs(content)
    return out


def plain_chat(http: requests.Session, root: str, body: dict[str, Any],
               timeout: float) -> Outcome:
    """Send `body` unstreamed (the cold run); same fields as `stream_chat`, no TTFT."""
    out = Outcome()
    start = time.perf_counter()
    tokens = is_tokens_body(body)
    url = root + ("/v1/completions" if tokens else "/v1/chat/completions")
    try:
        r = http.post(url, json={**body, "stream": False}, timeout=timeout)
        out.status = r.status_code
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {r.text[:200]}"
        elif tokens:
            data = r.json()
            choice = data["choices"][0]
            out.prompt_ids = choice.get("prompt_token_ids")
            out.prompt_tokens = data["usage"]["prompt_tokens"]
            out.cached_tokens = (data["usage"].get("prompt_tokens_details") or {}).get(
                "cached_tokens") or 0
            out.output_ids = list(choice.get("token_ids") or [])
            out.generation = parse_completion_logprobs(choice["logprobs"])
        else:
            data = r.json()
            choice = data["choices"][0]
            out.prompt_ids = data.get("prompt_token_ids")
            out.prompt_tokens = data["usage"]["prompt_tokens"]
            out.cached_tokens = (data["usage"].get("prompt_tokens_details") or {}).get(
                "cached_tokens") or 0
            out.text = str(choice["message"].get("content") or "")
            out.generation = parse_logprobs(choice["logprobs"]["content"])
    except (requests.RequestException, ValueError, KeyError, TypeError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
    out.e2e_s = time.perf_counter() - start
    return out
