"""Faults injected at seeded random times, each recorded with whether it went as expected.

Kinds (what each exercises is in docs/reliability.md):

- `disconnect_prefill` / `disconnect_stream`: a client closes its connection before the first
  token / after two tokens (vLLM aborts the request: pinned chains must be released, reserved
  links aborted);
- `clear_ram` / `clear_disk` / `clear_all` / `clear_anchors`: `POST /v1/cache/clear` of one
  tier, every tier, or the end anchors, while requests are in flight;
- `foreign_salt`: a prompt the shared domain just served, sent with a salt nobody used: it must
  miss (another tenant's links never serve) and equal its cold run;
- `malformed` / `oversized`: bodies the server must refuse with a 4xx, not a 5xx;
- `restore_failure`: the workers fail their next restore (`FaultInjection` worker extension);
  the request that hits it is recomputed cold and must equal its cold run;
- `restore_corruption`: a request whose restore the worker corrupts after every check of the
  bytes passed (`instrumentation.RestoreCorruption`); the checker, which is not told, must flag
  its answer (the summary's `corrupt_injected` / `corrupt_caught`);
- `kill_restart`: SIGKILL of the whole server, restart on the same `disk_dir` (in-flight
  requests fail, expected; the next life serves from the disk tier).

The schedule starts once the shared domain has served an answer (faults that replay one need
it), then draws kinds from seeded shuffles of the whole list (so every kind comes once per
round, `restore_corruption` `corrupt_per_round` times) at exponential gaps; a kind that needs
the disk tier is left out without one. A kill waits until the current life has served
`min_life_s` and the previous kill is `kill_gap_s` old, so restarts do not eat the run; the
other kinds go on meanwhile (`FaultRunner.kinds_in_order`).

Which request a corruption hits, and why not any: a corrupted state spreads. The request's
prefill writes attention K/V from it into vLLM's block pool (shared in place with later hits)
and captures links from it; a later request served from those would be wrong without having
been injected, and no count could tell the two apart. So the fault builds its own request: a
recent shared-domain prompt cut at its deepest cut (where that prompt's prefill captured a
link) plus one token no remembered prompt has there, sent on token ids with a `request_id`
the worker matches. Every block and link it writes from the corrupted state then holds that
token and matches no other prompt, and its answer's first token is computed from the restored
state itself (some tens of tokens of prefill after a restore wash a random-weight model's
state out, measured). The worker corrupts only a restore of exactly that depth (a shallower
hit would compute shared positions from the corrupted state) and says afterwards what it did;
a request it did not corrupt is an ordinary checked request, and the fault tries another.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import deque
from typing import Any

import requests

from benchmarks.soak.check import FLAGGED
from benchmarks.soak.client import chat_body, tokens_body
from benchmarks.soak.ledger import FaultRecord
from benchmarks.soak.traffic import Context, checked_request

KINDS = ("disconnect_prefill", "disconnect_stream", "clear_ram", "clear_disk", "clear_all",
         "clear_anchors", "foreign_salt", "malformed", "oversized", "restore_failure",
         "restore_corruption", "kill_restart")
DISK_ONLY = ("clear_disk", "kill_restart")
CORRUPT_ATTEMPTS = 3
"""Requests one `restore_corruption` fault sends at most until the worker corrupts one."""


def _fresh_messages(ctx: Context, rng: random.Random, words: int) -> list[dict[str, Any]]:
    """A recent shared-domain conversation (so a restore runs first) plus a new user message
    of `words` words (so a prefill follows); a fresh one if nothing was served yet."""
    recent = [b for b in ctx.ledger.recent() if "messages" in b]
    base = list(rng.choice(recent)["messages"]) if recent else []
    text = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega", "sigma"))
                    for _ in range(words))
    return [*base, {"role": "user", "content": f"{uuid.uuid4().hex} {text}"}]


class FaultRunner:
    """Runs the fault schedule in its own thread until the run stops."""

    def __init__(self, ctx: Context, seed: int, mean_gap_s: float, first_s: float,
                 kinds: tuple[str, ...], restart, min_life_s: float = 30.0,
                 kill_gap_s: float = 300.0, corrupt_per_round: int = 1) -> None:
        self.ctx = ctx
        self.rng = random.Random(f"soak-{seed}-faults")
        self.mean_gap_s = mean_gap_s
        self.first_s = first_s
        self.kinds = kinds
        self.restart = restart
        self.min_life_s = min_life_s
        self.kill_gap_s = kill_gap_s
        self.life_started = 0.0
        self.last_kill = -kill_gap_s
        self.http = ctx.session()
        self.corrupt_per_round = corrupt_per_round
        self.done: set[str] = set()
        """Kinds that have run at least once (`restore_corruption`: once it injected one)."""
        self.corruptions = 0
        """Requests whose restore the worker says it corrupted."""

    def schedule(self):
        """Kinds in seeded shuffled rounds."""
        while True:
            order = list(self.kinds)
            if "restore_corruption" in order:
                order += ["restore_corruption"] * (self.corrupt_per_round - 1)
            self.rng.shuffle(order)
            yield from order

    def _kill_due(self) -> float:
        """When a kill may fire: the life has served `min_life_s`, the last kill is
        `kill_gap_s` old."""
        return max(self.life_started + self.min_life_s, self.last_kill + self.kill_gap_s)

    def kinds_in_order(self):
        """The schedule as it runs: a kill not yet due waits aside while the other kinds go
        on (a kill gap longer than a round must not stall every other kind behind it; a later
        round's kill while one waits is the same kill), and a `restore_corruption` that
        injected nothing comes back after the next kind until one has (a loaded machine's
        budget can evict every target link of one try; CI needs one injected)."""
        schedule = self.schedule()
        upcoming: deque[str] = deque()
        kill_waiting = False
        while True:
            if kill_waiting and self._kill_due() <= self.ctx.now():
                kill_waiting, kind = False, "kill_restart"
            else:
                kind = upcoming.popleft() if upcoming else next(schedule)
                if kind == "kill_restart" and self._kill_due() > self.ctx.now() \
                        and set(self.kinds) != {"kill_restart"}:
                    kill_waiting = True
                    continue
            corruptions = self.corruptions
            yield kind
            if kind == "restore_corruption" and self.corruptions == corruptions == 0:
                if not upcoming:
                    upcoming.append(next(schedule))
                upcoming.insert(1, "restore_corruption")

    def run(self) -> None:
        ctx = self.ctx
        if ctx.stop.wait(self.first_s):
            return
        while not ctx.ledger.recent():
            if ctx.stop.wait(1.0):
                return
        for kind in self.kinds_in_order():
            if not ctx.wait_up():
                return
            if kind == "kill_restart":
                if ctx.stop.wait(max(0.0, self._kill_due() - ctx.now())) or not ctx.wait_up():
                    return
            life, t = ctx.server.life, ctx.now()
            try:
                expected, detail = getattr(self, kind)()
            except requests.RequestException as e:
                if ctx.killing.is_set() or ctx.server.life != life:
                    expected, detail = True, f"server killed meanwhile: {e}"[:200]
                else:
                    expected, detail = False, f"{type(e).__name__}: {e}"[:200]
            ctx.ledger.fault(FaultRecord(t=t, life=life, kind=kind, expected=expected,
                                         detail=detail))
            if kind != "restore_corruption" or self.corruptions:
                self.done.add(kind)
            if ctx.stop.wait(self.rng.expovariate(1.0 / self.mean_gap_s)):
                return

    # ----------------------------------------------------------------- helpers
    def _healthy(self) -> bool:
        """The server still answers /health (a fault must never take it down)."""
        for _ in range(30):
            try:
                if self.http.get(self.ctx.root + "/health", timeout=5).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            time.sleep(1.0)
        return False

    def _disconnect(self, after_tokens: int) -> tuple[bool, str]:
        ctx = self.ctx
        body = chat_body(ctx.model, _fresh_messages(ctx, self.rng, 600), None, 64, None)
        body.update(stream=True, stream_options={"include_usage": True})
        got = 0
        with self.http.post(ctx.root + "/v1/chat/completions", json=body, stream=True,
                            timeout=ctx.timeout_s) as r:
            if r.status_code != 200:
                return False, f"HTTP {r.status_code}"
            if after_tokens:
                for raw in r.iter_lines():
                    if raw.startswith(b"data:") and b'"logprobs"' in raw:
                        got += 1
                        if got >= after_tokens:
                            break
        # leaving the block closes the socket: vLLM aborts the request
        ok = self._healthy()
        return ok, f"closed after {got} token chunks; healthy={ok}"

    def disconnect_prefill(self) -> tuple[bool, str]:
        return self._disconnect(0)

    def disconnect_stream(self) -> tuple[bool, str]:
        return self._disconnect(2)

    def _clear(self, **params: str) -> tuple[bool, str]:
        r = self.http.post(self.ctx.root + "/v1/cache/clear", params=params, timeout=60)
        ok = r.status_code == 200 and r.json().get("cleared") is True
        return ok, f"{params}: HTTP {r.status_code} {r.text[:120]}"

    def clear_ram(self) -> tuple[bool, str]:
        return self._clear(tier="ram")

    def clear_disk(self) -> tuple[bool, str]:
        return self._clear(tier="disk")

    def clear_all(self) -> tuple[bool, str]:
        return self._clear(tier="all")

    def clear_anchors(self) -> tuple[bool, str]:
        return self._clear(kind="anchor")

    def foreign_salt(self) -> tuple[bool, str]:
        recent = self.ctx.ledger.recent()
        if not recent:
            return True, "nothing served yet: skipped"
        body = {**self.rng.choice(recent), "cache_salt": f"foreign-{uuid.uuid4().hex}"}
        rec, _ = checked_request(self.ctx, self.http, body, "fault:foreign_salt")
        if rec.outcome == "ok" and rec.cached_tokens:
            rec.outcome, rec.cause = "unexpected_error", "foreign_salt_hit"
            return False, f"another salt was served {rec.cached_tokens} cached tokens"
        return rec.outcome != "unexpected_error", f"{rec.outcome} {rec.cause} {rec.check}"

    def malformed(self) -> tuple[bool, str]:
        ctx = self.ctx
        url = ctx.root + "/v1/chat/completions"
        good = chat_body(ctx.model, [{"role": "user", "content": "hi"}], None, 4, None)
        cases: list[tuple[str, dict[str, Any]]] = [
            ("not json", {"data": b'{"model": "x", "messages": [', "headers":
                          {"Content-Type": "application/json"}}),
            ("no messages", {"json": {k: v for k, v in good.items() if k != "messages"}}),
            ("messages not a list", {"json": {**good, "messages": "hello"}}),
            ("cache_salt not a string", {"json": {**good, "cache_salt": 12}}),
            ("cache_salt empty", {"json": {**good, "cache_salt": ""}}),
            ("negative max_tokens", {"json": {**good, "max_tokens": -3}}),
            ("unknown model", {"json": {**good, "model": "no-such-model"}}),
            ("top_logprobs too many", {"json": {**good, "top_logprobs": 10_000}}),
        ]
        name, kw = self.rng.choice(cases)
        target = url
        if self.rng.random() < 0.3:
            name, target, kw = "clear of an unknown tier", ctx.root + "/v1/cache/clear", {
                "params": {"tier": "floppy"}}
        r = self.http.post(target, timeout=60, **kw)
        ok = 400 <= r.status_code < 500 and self._healthy()
        return ok, f"{name}: HTTP {r.status_code} {r.text[:120]}"

    def oversized(self) -> tuple[bool, str]:
        ctx = self.ctx
        limit = ctx.server.settings.max_model_len
        if self.rng.random() < 0.5:
            name = "prompt longer than max_model_len"
            msgs = [{"role": "user", "content": "word " * (limit + 64)}]
            body = chat_body(ctx.model, msgs, None, 4, None)
        else:
            name = "max_tokens beyond the context"
            body = chat_body(ctx.model, [{"role": "user", "content": "hi"}], None, limit * 4,
                             None)
        r = self.http.post(ctx.root + "/v1/chat/completions", json=body, timeout=120)
        ok = 400 <= r.status_code < 500 and self._healthy()
        return ok, f"{name}: HTTP {r.status_code} {r.text[:120]}"

    def restore_failure(self) -> tuple[bool, str]:
        ctx = self.ctx
        r = self.http.post(ctx.root + "/collective_rpc", timeout=60,
                           json={"method": "hybridcache_fail_loads", "args": ["1"]})
        if r.status_code != 200:
            return False, f"collective_rpc: HTTP {r.status_code} {r.text[:120]}"
        recent = ctx.ledger.recent()
        if not recent:
            return True, "armed; nothing served yet to hit"
        rec, _ = checked_request(ctx, self.http, dict(self.rng.choice(recent)),
                                 "fault:restore_failure")
        return rec.outcome != "unexpected_error", (
            f"armed; the replayed request: {rec.outcome} {rec.cause} check={rec.check} "
            f"cached={rec.cached_tokens}")

    def _rpc(self, method: str, *args: str) -> list:
        """`POST /collective_rpc`: every worker's answer."""
        r = self.http.post(self.ctx.root + "/collective_rpc", timeout=60,
                           json={"method": method, "args": list(args)})
        r.raise_for_status()
        return r.json().get("results") or []

    def _corruption_targets(self) -> list[tuple[list[int], int]]:
        """Recent shared-domain prompts, each with its deepest cut short of its last token
        (where its prefill captured a link, unless evicted since), newest first: the links
        likeliest to be still held (a small RAM budget evicts the oldest first, and a loaded
        machine's run has more of them in flight when the fault fires)."""
        seg = self.ctx.segmentation
        found = []
        for ids in reversed(self.ctx.ledger.recent_prompts()):
            cuts = seg.cuts(ids, len(ids) - 1)
            if cuts:
                found.append((ids, cuts[-1]))
        return found

    def _diverging_token(self, ids: list[int], cut: int) -> int:
        """A token for position `cut` that no remembered prompt sharing `ids[:cut]` has there
        (so nothing computed after the restore is shared with another prompt), drawn from the
        prompt's own ids (every one a valid id of the vocabulary)."""
        taken = {ids[cut]} | {q[cut] for q in self.ctx.ledger.recent_prompts()
                              if len(q) > cut and q[:cut] == ids[:cut]}
        pool = sorted(set(ids) - taken)
        return self.rng.choice(pool) if pool else max(taken) + 1

    def restore_corruption(self) -> tuple[bool, str]:
        """Send a request built to be restored at a known link, with the worker armed to
        corrupt exactly that restore (module docstring); mark its record `injected` when the
        worker says it did. The record was judged before that, like any other: whether the
        check flagged it is the summary's business (report.corruptions)."""
        ctx = self.ctx
        tried: list[str] = []
        targets = self._corruption_targets()
        target = targets.pop(0) if targets else None
        for _ in range(CORRUPT_ATTEMPTS):
            if target is None:
                break
            ids, cut = target
            tag = f"soak-corrupt-{uuid.uuid4().hex}"
            armed = self._rpc("hybridcache_corrupt_restore", tag, str(cut))
            if not armed or not all(isinstance(r, dict) and r.get("armed") for r in armed):
                return False, f"the workers were not armed: {armed}"[:200]
            body = {**tokens_body(ctx.model, [*ids[:cut], self._diverging_token(ids, cut)],
                                  ctx.max_tokens, None), "request_id": tag}
            rec, _ = checked_request(ctx, self.http, body, "fault:restore_corruption",
                                     remember=False)
            done = [x for x in self._rpc("hybridcache_corruption_result", tag)
                    if isinstance(x, dict)]
            hit = next((x for x in done if x["corrupted"]), None)
            if hit is not None:
                self.corruptions += 1
                rec.injected = "restore_corruption"
                rec.restore = (f"{hit['tier']}/{hit['kind']} {hit['tokens']} tokens, "
                               f"{hit['sections']} state sections, {hit['req_id']}")
                flagged = rec.cause in FLAGGED
                return rec.outcome != "unexpected_error" or flagged, (
                    f"injected ({rec.restore}); the answer: {rec.outcome} {rec.cause} "
                    f"check={rec.check} {rec.detail}"[:300])
            got = done[0]["tokens"] if done else 0
            tried.append(f"cut {cut}: restored {got}" if done else f"cut {cut}: no restore")
            if rec.outcome != "ok":  # a non-injected answer must pass like any other
                return rec.outcome == "expected_error", (
                    f"not injected ({tried[-1]}); the request: {rec.cause} {rec.detail}"[:300])
            # the link at `cut` was gone: one the lookup just found is likelier to stay
            target = ((ids, got) if 0 < got < cut and got in ctx.segmentation.cuts(ids)
                      else targets.pop(0) if targets else None)
        return True, f"nothing injected ({'; '.join(tried) or 'no recent prompt with a cut'})"

    def kill_restart(self) -> tuple[bool, str]:
        self.last_kill = self.ctx.now()
        took = self.restart()
        self.life_started = self.ctx.now()
        return True, f"killed with SIGKILL, restarted in {took:.0f} s"
