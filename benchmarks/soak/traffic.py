"""Concurrent agent sessions and sub-agents from the trace families, every answer checked.

Each worker thread replays one trace after another (family, trace seed, history mode and arm
drawn from its own seeded generator; the arm says whose cache a trace uses, see
`RequestRecord.arm`), sending each wave's requests at once (sub-agents and
concurrent sessions are several per wave). After each answer it sends the cold run of the same
body (`client.cold_salt`) and compares the two (`check.compare`). Trace seeds come from a
small pool, so a head or a whole conversation comes back after others evicted or kept it.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import requests

from benchmarks.soak.check import compare, judge
from benchmarks.soak.client import (
    Outcome,
    chat_body,
    cold_salt,
    plain_chat,
    stream_chat,
    tokens_body,
)
from benchmarks.soak.ledger import Ledger, RequestRecord
from benchmarks.soak.server import SoakServer
from benchmarks.traces import Trace, generate
from vllm_hybridcache.segmentation import Segmentation

ARMS = ("cache", "tenant", "control")


class Context:
    """What traffic and faults share: the server, the ledger, the request settings."""

    def __init__(self, server: SoakServer, ledger: Ledger, *, model: str, size: str,
                 max_tokens: int, drift_nats: float, segmentation: Segmentation,
                 anchor_drift_nats: float | None = None, timeout_s: float = 600.0) -> None:
        self.server = server
        self.ledger = ledger
        self.model = model
        self.size = size
        self.max_tokens = max_tokens
        self.drift_nats = drift_nats
        self.anchor_drift_nats = anchor_drift_nats
        """The end-anchor gate's tolerance; None: anchor hits are reported, not judged."""
        self.segmentation = segmentation
        self.timeout_s = timeout_s
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.killing = threading.Event()
        """Set from just before a kill -9 until the next life answers."""

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def root(self) -> str:
        return self.server.base_url

    def session(self) -> requests.Session:
        http = requests.Session()
        http.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=16))
        return http

    def wait_up(self) -> bool:
        """Block while the server is down (a kill -9 and restart); False once the run stops."""
        while not self.server.up.wait(1.0):
            if self.stop.is_set():
                return False
        return True

    def failure_cause(self, out: Outcome, life: int) -> tuple[str, str]:
        """(outcome, cause) of a failed exchange: expected only when the server was killed
        while it ran (the kill -9 fault); anything else is unexpected."""
        if self.killing.is_set() or self.server.life != life or not self.server.up.is_set():
            return "expected_error", "server_killed"
        if out.status is not None and out.status != 200:
            return "unexpected_error", f"http_{out.status}"
        err = out.error or ""
        if err.startswith("stream error"):
            return "unexpected_error", "stream_error"
        return "unexpected_error", "connection" if "Error" in err.split(":")[0] else "protocol"


@lru_cache(maxsize=64)
def _trace(family: str, size: str, seed: int) -> Trace:
    return generate(family, size, seed)


def checked_request(ctx: Context, http: requests.Session, body: dict[str, Any], arm: str,
                    family: str = "", remember: bool = True) -> tuple[RequestRecord, Outcome]:
    """Send `body`, then its cold run, compare them, record and return the result; an answer
    that passed is remembered for faults to replay unless `remember` is False. A `request_id`
    in `body` (how a fault names the request the worker must act on) is not sent with the
    cold run."""
    if not ctx.wait_up():
        return RequestRecord(t=ctx.now(), life=ctx.server.life, arm=arm, family=family,
                             outcome="expected_error", cause="run_stopped"), Outcome()
    life = ctx.server.life
    rec = RequestRecord(t=ctx.now(), life=life, arm=arm, family=family)
    out = stream_chat(http, ctx.root, body, ctx.timeout_s)
    rec.prompt_tokens, rec.cached_tokens = out.prompt_tokens, out.cached_tokens
    rec.ttft_s, rec.e2e_s = out.ttft_s, out.e2e_s
    if out.error is not None:
        rec.outcome, rec.cause = ctx.failure_cause(out, life)
        rec.detail = out.error
        ctx.ledger.add(rec)
        return rec, out
    if out.cached_tokens and out.prompt_ids is not None:
        cuts = ctx.segmentation.cuts(out.prompt_ids)
        rec.hit_kind = "tree" if out.cached_tokens in cuts else "anchor"
    elif out.cached_tokens:
        rec.hit_kind = "tree"
    cold_body = {k: v for k, v in body.items() if k != "request_id"}
    cold = plain_chat(http, ctx.root, {**cold_body, "cache_salt": cold_salt()}, ctx.timeout_s)
    if cold.error is not None:
        rec.outcome, rec.cause = ctx.failure_cause(cold, life)
        rec.cause = "cold_run_" + rec.cause
        rec.detail = cold.error
    elif cold.cached_tokens:
        rec.outcome, rec.cause = "unexpected_error", "cold_run_hit"
        rec.detail = f"a fresh cache_salt was served {cold.cached_tokens} cached tokens"
    else:
        assert out.generation is not None and cold.generation is not None
        v = compare(out.generation, cold.generation, ctx.drift_nats)
        rec.check, rec.compared, rec.margin, rec.max_drift = (v.outcome, v.compared, v.margin,
                                                              v.max_drift)
        outcome, cause, detail = judge(v, rec.hit_kind, ctx.drift_nats, ctx.anchor_drift_nats,
                                       control=arm == "control")
        if outcome != "ok":
            rec.outcome, rec.cause, rec.detail = outcome, cause, detail
    if arm == "control" and out.cached_tokens:
        rec.outcome, rec.cause = "unexpected_error", "control_hit"
    ctx.ledger.add(rec)
    if remember and rec.outcome == "ok" and body.get("cache_salt") is None:
        ctx.ledger.remember(body, out.prompt_ids)
    return rec, out


HISTORIES = ("scripted", "live", "tokens")


class _Plan:
    """How the requests of one replayed trace are sent (arm, salt, history mode).

    History modes: `scripted` sends the trace's messages; `live` puts the model's own answers
    in the history (re-rendered by the chat template); `tokens` sends a session's first turn as
    a chat and each later turn as a completion on token ids: the previous prompt, the previous
    answer's ids, and a slice of earlier prompt ids as the new message, so the next prompt
    extends exactly where the last answer stopped (an end anchor's position).
    """

    def __init__(self, trace: Trace, family: str, arm: str, tenant: str, history: str,
                 rng: random.Random) -> None:
        self.trace, self.family, self.arm, self.tenant = trace, family, arm, tenant
        self.history = history
        self.answers: dict[tuple[str, int], dict[str, Any]] = {}
        self.ids: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.rng = rng

    def _salt(self) -> str | None:
        return {"cache": None, "tenant": self.tenant, "control": cold_salt()}[self.arm]

    def send(self, ctx: Context, http: requests.Session, req) -> Outcome:
        msgs = self.trace.messages(req)
        if self.history == "live":
            msgs = [self.answers.get((req.session, i), m) for i, m in enumerate(msgs)]
        body = chat_body(ctx.model, msgs, self.trace.tools(req), ctx.max_tokens, self._salt())
        with self.lock:
            seen = self.ids.get(req.session)
            extra = self.rng.randint(32, 256)
            start = self.rng.randrange(max(1, len(seen) - extra)) if seen else 0
        if self.history == "tokens" and seen is not None:
            limit = ctx.server.settings.max_model_len - ctx.max_tokens - 64
            if len(seen) + extra <= limit:
                body = tokens_body(ctx.model, seen + seen[start:start + extra],
                                   ctx.max_tokens, self._salt())
        out = checked_request(ctx, http, body, self.arm, self.family)[1]
        if self.history == "tokens" and out.error is None and out.prompt_ids is not None:
            with self.lock:
                self.ids[req.session] = out.prompt_ids + (out.generation.tokens
                                                          if out.generation else [])
        return out

    def after_wave(self, wave, outs: list[Outcome]) -> None:
        if self.history != "live":
            return
        for req, out in zip(wave, outs, strict=True):
            answer: dict[str, Any] = {"role": "assistant", "content": out.text}
            scripted = self.trace.answer(req)
            if scripted.get("tool_calls"):
                answer["tool_calls"] = scripted["tool_calls"]
            self.answers[(req.session, req.n_messages)] = answer


def session_worker(ctx: Context, index: int, *args) -> None:
    """`replay_traces`, with any exception of the runner itself recorded as an unexpected
    error (it fails the run) instead of silently ending the thread."""
    try:
        replay_traces(ctx, index, *args)
    except Exception as e:
        ctx.ledger.add(RequestRecord(t=ctx.now(), life=ctx.server.life, arm="runner",
                                     outcome="unexpected_error", cause="runner_error",
                                     detail=traceback.format_exc()[-1500:]))
        print(f"soak: worker {index} stopped: {e!r}", flush=True)


def replay_traces(ctx: Context, index: int, seed: int, trace_seeds: int,
                  families: tuple[str, ...], arm_weights: tuple[float, float, float],
                  history_weights: tuple[float, float, float]) -> None:
    """Replay traces until the run stops (see the module docstring)."""
    rng = random.Random(f"soak-{seed}-worker-{index}")
    http = ctx.session()
    first = True
    while not ctx.stop.is_set():
        family = rng.choice(families)
        trace = _trace(family, ctx.size, rng.randrange(trace_seeds))
        # worker i starts in arm i: with three workers every arm runs from the start, side by
        # side under the same load; later traces draw their arm by weight
        arm = ARMS[index % len(ARMS)] if first else rng.choices(ARMS, weights=arm_weights)[0]
        first = False
        history = rng.choices(HISTORIES, weights=history_weights)[0]
        tenant = f"tenant-{rng.randrange(2)}"
        plan = _Plan(trace, family, arm, tenant, history,
                     random.Random(f"{seed}-{index}-{rng.random()}"))
        for wave in trace.waves():
            if ctx.stop.is_set():
                break
            if len(wave) == 1:
                outs = [plan.send(ctx, http, wave[0])]
            else:       # one HTTP session per thread (requests.Session is not thread-safe)
                with ThreadPoolExecutor(max_workers=len(wave)) as pool:
                    outs = list(pool.map(lambda r, p=plan: p.send(ctx, ctx.session(), r),
                                         wave))
            plan.after_wave(wave, outs)
