"""Replay a trace against one OpenAI-compatible server and measure what its cache did.

Each request is a streamed chat completion (`/v1/chat/completions`) with the trace's messages and
tools, so the server renders the prompt with the model's real chat template. The replayer
records, per request: the server's prompt tokens and cached tokens
(`usage.prompt_tokens_details.cached_tokens`, which vLLM fills when started with
`--enable-prompt-tokens-details`), the time to the first generated token, the end-to-end time and
any error. After the replay it computes the ideal cached prefix of every request from what the
server actually processed (see `benchmarks.ideal`).

History modes (`--history`):
- `scripted` (default): the history holds the trace's scripted assistant turns; the server's
  answer is used only for timing and token counts. Every system sees byte-identical prompts, so
  the systems are compared on the same work. The embedded models have random weights, so their
  answers could not drive a conversation anyway.
- `live`: the server's answer text replaces the scripted assistant content (scripted tool calls
  and tool results stay, so the conversation keeps its shape). This measures live continuation:
  the next prompt extends what the model really generated, re-rendered by the chat template
  (reasoning dropped, text re-tokenized), which is where caches that keep the end of the last
  generation win or lose. Prompts then differ between systems if their answers differ.

Generation is greedy with `ignore_eos` and a fixed `max_tokens`, so every request decodes the
same number of tokens on every system and end-to-end times compare prefill work.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import requests

from benchmarks.ideal import PromptTokenizer, ideal_cached
from benchmarks.image_keys import collapse, ideal_ids, image_refs, pad_id
from benchmarks.traces.model import Message, Request, Trace


class ReplayConfig(msgspec.Struct, frozen=True):
    """How to talk to the server; identical for every system of a run."""

    base_url: str
    """Server root, e.g. http://127.0.0.1:8100 (a trailing /v1 is accepted)."""
    model: str
    """Served model name (what goes in the request's `model` field)."""
    max_tokens: int = 16
    history: str = "scripted"
    tool_choice: str = "none"
    """`none` keeps tool definitions in the prompt but needs no tool parser on the server."""
    api_key: str | None = None
    timeout_s: float = 900.0
    stats_poll_s: float = 0.5
    warmup: bool = True


class RequestResult(msgspec.Struct):
    """What one request did; `None` means the server did not report it."""

    index: int
    session: str
    turn: int
    wave: int
    prompt_tokens: int | None = None
    local_prompt_tokens: int = 0
    cached_tokens: int | None = None
    ideal_tokens: int = 0
    completion_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_ids_match: bool | None = None
    error: str | None = None


class ReplayResult(msgspec.Struct):
    """One system's replay of one trace."""

    requests: list[RequestResult]
    wall_s: float
    peak_snapshot_bytes: int | None
    peak_snapshot_bytes_by_tier: dict[str, int]
    cache_stats_route: bool
    """True if the server answered GET /v1/cache/stats (the plugin's route)."""
    overhead: dict[str, Any] | None = None
    """The plugin's own seconds in the engine's steps during the replay (the route's
    `overhead` at the end less at the start), with its `share` of the step time."""


def overhead_delta(first: dict[str, Any] | None, last: dict[str, Any] | None
                   ) -> dict[str, Any] | None:
    """The growth of the route's cumulative `overhead` between two polls, with the plugin's
    share of the step time over that span (adapter/overhead.py); None without both polls."""
    from vllm_hybridcache.adapter.overhead import share

    if not first or not last:
        return None
    out: dict[str, Any] = {}
    for side in ("scheduler_s", "worker_s"):
        old = first.get(side, {})
        out[side] = {k: round(v - old.get(k, 0.0), 6) for k, v in last.get(side, {}).items()}
    out["busy_s"] = round(last.get("busy_s", 0.0) - first.get("busy_s", 0.0), 6)
    out["steps"] = last.get("steps", 0) - first.get("steps", 0)
    out["share"] = share(out)
    return out


def server_root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def snapshot_bytes(stats: Any) -> dict[str, int]:
    """Bytes of snapshots held per tier, from the plugin's /v1/cache/stats JSON.

    The plugin answers `{"tiers": {"ram": {"bytes_held": N, ...}, ...}, ...}`; a server that
    reports only a top-level `bytes_held` gives `{"total": N}`. Empty if neither is there.
    """
    out: dict[str, int] = {}
    if not isinstance(stats, dict):
        return out
    tiers = stats.get("tiers")
    if isinstance(tiers, dict):
        for tier, entry in tiers.items():
            if isinstance(entry, dict) and isinstance(entry.get("bytes_held"), int | float):
                out[str(tier)] = int(entry["bytes_held"])
    if not out and isinstance(stats.get("bytes_held"), int | float):
        out["total"] = int(stats["bytes_held"])
    return out


def headline_bytes(by_tier: dict[str, int]) -> int | None:
    """The report's "peak snapshot bytes": the RAM tier (what competes with the KV cache and
    the OS for memory) when there is one, else the sum of what is reported."""
    if not by_tier:
        return None
    return by_tier["ram"] if "ram" in by_tier else sum(by_tier.values())


class _StatsPoller:
    """Polls /v1/cache/stats during a replay and keeps the largest byte count seen."""

    def __init__(self, root: str, interval: float, headers: dict[str, str]) -> None:
        self.url = root + "/v1/cache/stats"
        self.interval = interval
        self.headers = headers
        self.peak: dict[str, int] = {}
        self.route = False
        self.overhead: list[dict[str, Any]] = []  # the first and the latest `overhead` seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        try:
            r = requests.get(self.url, headers=self.headers, timeout=5)
        except requests.RequestException:
            return
        if r.status_code != 200:
            return
        try:
            stats = r.json()
        except ValueError:
            return
        value = snapshot_bytes(stats)
        self.route = True
        if isinstance(stats, dict) and isinstance(stats.get("overhead"), dict):
            self.overhead = [*self.overhead[:1], stats["overhead"]]
        for tier, n in value.items():
            self.peak[tier] = max(self.peak.get(tier, 0), n)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def __enter__(self) -> _StatsPoller:
        self.poll()
        if self.route:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.poll()


class _Outcome(msgspec.Struct):
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_ids: list[int] | None = None
    output_ids: list[int] = msgspec.field(default_factory=list)
    text: str = ""
    error: str | None = None


def _stream(session: requests.Session, url: str, body: dict[str, Any],
            headers: dict[str, str], timeout: float) -> _Outcome:
    """Send one streamed chat completion; time the first generated token and the end."""
    out = _Outcome()
    start = time.perf_counter()
    try:
        with session.post(url, json=body, headers=headers, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return out
            for chunk in sse_chunks(r):
                if "error" in chunk:
                    out.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    break
                if chunk.get("prompt_token_ids") is not None:
                    out.prompt_ids = list(chunk["prompt_token_ids"])
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    ids = choice.get("token_ids") or []
                    piece = "".join(str(delta.get(k) or "")
                                    for k in ("content", "reasoning", "reasoning_content"))
                    generated = bool(ids) or bool(piece) or bool(delta.get("tool_calls"))
                    if generated and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - start
                    out.output_ids.extend(ids)
                    out.text += str(delta.get("content") or "")
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens")
                    out.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens")
    except (requests.RequestException, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
    out.e2e_s = time.perf_counter() - start
    if out.error is None and out.prompt_tokens is None:
        out.error = "no usage in the stream (server ignored stream_options.include_usage)"
    return out


def sse_chunks(response: requests.Response) -> Iterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI server-sent-events stream, up to its `[DONE]`."""
    for raw in response.iter_lines():
        if not raw or not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _warmup(session: requests.Session, root: str, cfg: ReplayConfig,
            headers: dict[str, str]) -> None:
    """One short request outside the trace, so first-request start-up costs stay out of it.

    Its prompt (a lone user message) shares at most its first token or two with any trace prompt,
    far below any cache block or snapshot cut, so it cannot feed a later hit.
    """
    body = {"model": cfg.model, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "warm up " * 16}]}
    r = session.post(root + "/v1/chat/completions", json=body, headers=headers,
                     timeout=cfg.timeout_s)
    r.raise_for_status()


def replay(trace: Trace, cfg: ReplayConfig, tokenizer: PromptTokenizer,
           after_wave: Callable[[list[int]], None] | None = None) -> ReplayResult:
    """Send the trace wave by wave and measure every request (see the module docstring).

    `after_wave(indices)` runs after each wave with the indices of its requests (a benchmark
    reads server-side counters there). Image parts are accounted by `benchmarks.image_keys`.
    """
    if cfg.history not in ("scripted", "live"):
        raise ValueError(f"history must be 'scripted' or 'live', not {cfg.history!r}")
    root = server_root(cfg.base_url)
    url = root + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    http = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=64)
    http.mount("http://", adapter)
    http.mount("https://", adapter)
    if cfg.warmup:
        _warmup(http, root, cfg, headers)

    # live mode: (session, message index) -> the server's answer replacing the scripted one
    live: dict[tuple[str, int], Message] = {}

    def messages_for(req: Request) -> list[Message]:
        msgs = trace.messages(req)
        if cfg.history == "scripted":
            return msgs
        return [live.get((req.session, i), m) for i, m in enumerate(msgs)]

    index = {id(r): i for i, r in enumerate(trace.requests)}
    sent: dict[int, list[Message]] = {}
    outcomes: dict[int, _Outcome] = {}

    def run_one(req: Request) -> tuple[int, _Outcome]:
        i = index[id(req)]
        msgs = sent[i]
        body: dict[str, Any] = {
            "model": cfg.model, "messages": msgs, "max_tokens": cfg.max_tokens,
            "temperature": 0, "seed": 0, "ignore_eos": True, "return_token_ids": True,
            "stream": True, "stream_options": {"include_usage": True},
        }
        tools = trace.tools(req)
        if tools:
            body["tools"] = tools
            body["tool_choice"] = cfg.tool_choice
        return i, _stream(http, url, body, headers, cfg.timeout_s)

    start = time.perf_counter()
    with _StatsPoller(root, cfg.stats_poll_s, headers) as poller:
        for wave in trace.waves():
            for req in wave:
                sent[index[id(req)]] = messages_for(req)
            with ThreadPoolExecutor(max_workers=len(wave)) as pool:
                for i, out in pool.map(run_one, wave):
                    outcomes[i] = out
            if after_wave is not None:
                after_wave([index[id(req)] for req in wave])
            if cfg.history == "live":
                for req in wave:
                    scripted = trace.answer(req)
                    answer: Message = {"role": "assistant",
                                       "content": outcomes[index[id(req)]].text}
                    if scripted.get("tool_calls"):
                        answer["tool_calls"] = scripted["tool_calls"]
                    live[(req.session, req.n_messages)] = answer
    wall = time.perf_counter() - start

    results: list[RequestResult] = []
    prompts: list[list[int]] = []
    seen: list[list[int]] = []
    pad = pad_id(tokenizer)
    for i, req in enumerate(trace.requests):
        out = outcomes[i]
        local = tokenizer.prompt_ids(sent[i], trace.tools(req))
        # What the server processed: its own prompt ids when it returns them (they are the
        # truth; they equal `local` unless the template drifted), then the tokens it generated.
        server_prompt = out.prompt_ids if out.prompt_ids is not None else local
        shown = out.prompt_ids
        refs = image_refs(sent[i]) if pad is not None else []
        if refs:  # pad runs named by their image; the local render has one pad per image
            server_prompt = ideal_ids(server_prompt, pad, refs)
            shown = None if shown is None else collapse(shown, pad)
        prompts.append(server_prompt)
        answer_ids = out.output_ids or tokenizer.encode(out.text)
        seen.append(server_prompt + answer_ids if out.error is None else [])
        results.append(RequestResult(
            index=i, session=req.session, turn=req.turn, wave=req.wave,
            prompt_tokens=out.prompt_tokens, local_prompt_tokens=len(local),
            cached_tokens=out.cached_tokens, completion_tokens=out.completion_tokens,
            ttft_s=out.ttft_s, e2e_s=out.e2e_s,
            prompt_ids_match=None if shown is None else shown == local,
            error=out.error))
    ideal = ideal_cached([r.wave for r in trace.requests], prompts, seen)
    for res, value in zip(results, ideal, strict=True):
        res.ideal_tokens = value
    return ReplayResult(requests=results, wall_s=wall,
                        peak_snapshot_bytes=headline_bytes(poller.peak),
                        peak_snapshot_bytes_by_tier=dict(poller.peak),
                        cache_stats_route=poller.route,
                        overhead=overhead_delta(poller.overhead[0], poller.overhead[-1])
                        if len(poller.overhead) == 2 else None)
