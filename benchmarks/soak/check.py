"""The greedy check: a served response against the same prompt served cold in the same engine.

vLLM's CPU forward is not batch-invariant: a token's arithmetic depends on the other tokens of
its step, so two cold runs of one prompt under load can differ in the last bits of every
logprob. In float32 that drift is microscopic (the end-anchor gate measured at most 2.4e-6
nats), so it can only swap two tokens whose cold margin is itself microscopic. The check walks
both runs position by position:

- same pick: the largest |logprob difference| over the top tokens both report is the drift;
- different pick: a *tie divergence* (expected, counted) only when the batching drift explains
  it: the cold run's margin between its pick and the served pick is at most `2 * drift_nats`,
  and the logprobs both runs report at that position differ by at most `drift_nats` (the rule
  of every same-pick position); anything else is a *wrong token* (the one outcome that fails
  the run). The walk stops at the first different pick (the continuations differ from there).

Why the tie also looks at the logprobs: the tiny models have random weights and flat
distributions (the cold run's top 5 within about half a nat), so in bf16, where the tolerance is
0.25 nats, a corrupted state's pick can sit within the tie margin of the cold pick while the two
runs' top-5 lists share no token at all; a flip by batching drift moves logprobs by at most the
drift, so both runs still report the two leaders at nearly the same values.

A corrupted restore moves logprobs far beyond the drift: it shows as a wrong token, or, if its
greedy picks happen to agree, as drift above `drift_nats` (the runner counts that as the
unexpected error `drift_exceeded`, as the end-anchor gate fails it). The soak run's
`restore_corruption` fault measures that: every restore it corrupts must be flagged.
"""

from __future__ import annotations

import msgspec

# Same tolerance as the end-anchor gate (tests/connector/test_end_anchors.py): float32 drift was
# measured below 2.4e-6 nats; a factor > 400 is left for other CPUs and batch shapes.
DRIFT_NATS = 1e-3


class Generation(msgspec.Struct):
    """Token ids a request generated and, per position, its top logprobs by token id."""

    tokens: list[int]
    top: list[dict[int, float]]


class Verdict(msgspec.Struct):
    """What the comparison of one served response with its cold run found."""

    compared: int
    """Positions compared (up to and including the first different pick)."""
    outcome: str
    """`same`, `tie` (a different pick within the cold margin), `wrong` (a different pick with
    a real margin) or `length` (the runs generated different numbers of tokens)."""
    max_drift: float
    """Largest logprob difference seen at positions with the same tokens so far."""
    margin: float | None = None
    """The cold run's margin at the first different pick."""
    position: int | None = None
    flip_drift: float | None = None
    """At the first different pick: the largest logprob difference over the top tokens both
    runs report; None there when they report none in common (or the picks never differ)."""


def parse_logprobs(content: list[dict]) -> Generation:
    """A `Generation` from an OpenAI chat `logprobs.content` list rendered with
    `return_tokens_as_token_ids` (tokens spelled `token_id:N`, so two ids decoding to the same
    text never merge)."""
    tokens: list[int] = []
    top: list[dict[int, float]] = []
    for entry in content:
        tokens.append(_token_id(entry["token"]))
        row = {_token_id(t["token"]): float(t["logprob"]) for t in entry.get("top_logprobs") or []}
        row.setdefault(tokens[-1], float(entry["logprob"]))
        top.append(row)
    return Generation(tokens=tokens, top=top)


def parse_completion_logprobs(logprobs: dict) -> Generation:
    """The same from a `/v1/completions` `logprobs` object (`tokens`, `token_logprobs`,
    `top_logprobs`), also spelled as token ids."""
    tokens = [_token_id(t) for t in logprobs.get("tokens") or []]
    top: list[dict[int, float]] = []
    for i, row in enumerate(logprobs.get("top_logprobs") or []):
        entry = {_token_id(t): float(lp) for t, lp in (row or {}).items()}
        entry.setdefault(tokens[i], float(logprobs["token_logprobs"][i]))
        top.append(entry)
    return Generation(tokens=tokens, top=top)


def _token_id(token: str) -> int:
    prefix = "token_id:"
    if not token.startswith(prefix):
        raise ValueError(f"logprob token {token!r} is not spelled token_id:N "
                         "(request return_tokens_as_token_ids)")
    return int(token[len(prefix):])


def compare(served: Generation, cold: Generation, drift_nats: float = DRIFT_NATS) -> Verdict:
    """Walk both generations (see the module docstring)."""
    worst = 0.0
    for i, (w, c) in enumerate(zip(served.tokens, cold.tokens, strict=False)):
        top_w, top_c = served.top[i], cold.top[i]
        shared = top_w.keys() & top_c.keys()
        here = max((abs(top_w[k] - top_c[k]) for k in shared), default=None)
        if w != c:
            # the served pick missing from the cold top-k is below its smallest entry
            low = top_c.get(w, min(top_c.values()))
            margin = top_c[c] - low
            tie = margin <= 2 * drift_nats and here is not None and here <= drift_nats
            return Verdict(compared=i + 1, outcome="tie" if tie else "wrong", max_drift=worst,
                           margin=margin, position=i, flip_drift=here)
        if here is not None:
            worst = max(worst, here)
    if len(served.tokens) != len(cold.tokens):
        return Verdict(compared=min(len(served.tokens), len(cold.tokens)), outcome="length",
                       max_drift=worst)
    return Verdict(compared=len(cold.tokens), outcome="same", max_drift=worst)


def judge(v: Verdict, hit_kind: str | None, drift_nats: float,
          anchor_drift_nats: float | None, control: bool = False) -> tuple[str, str, str]:
    """(outcome, cause, detail) of a checked answer: `ok` or `unexpected_error`.

    The control arm (`control`: a fresh salt, the cache cannot serve it) is the cache-off
    baseline: what two cold runs of one prompt differ by under the same load. Its verdicts are
    recorded and reported as the cache-off divergence rate, never failures of the cache.

    Tree hits and misses are cold-exact: a wrong token, a length mismatch or drift beyond
    `drift_nats` with the same picks fails them. End-anchor hits (`hit_kind == "anchor"`) are
    session-exact, their state descends from decode steps: they are held to the end-anchor gate,
    `anchor_drift_nats`; None (bf16, where the decode-vs-prefill drift is the CPU kernels' and
    no tolerance is both safe and tight) records their verdict without judging it.
    """
    if control:
        return "ok", "", ""
    tol = drift_nats
    if hit_kind == "anchor":
        if anchor_drift_nats is None:
            return "ok", "", ""
        tol = anchor_drift_nats
    if v.outcome == "wrong":
        moved = ("no top token in common" if v.flip_drift is None
                 else f"logprobs there moved {v.flip_drift:.3g} nats")
        return ("unexpected_error", "wrong_token",
                f"position {v.position}: cold margin {v.margin:.3g} nats, {moved}")
    if v.outcome == "length":
        return "unexpected_error", "length_mismatch", ""
    if v.max_drift > tol:
        # same picks, but logprobs moved beyond the drift batching can cause (the end-anchor
        # gate's rule): state that is not the cold run's
        return "unexpected_error", "drift_exceeded", f"logprobs moved by {v.max_drift:.3g} nats"
    return "ok", "", ""


FLAGGED = ("wrong_token", "length_mismatch", "drift_exceeded")
"""The causes `judge` gives an answer that is not its cold run's: what "caught" means for an
answer served from a corrupted restore (benchmarks/soak/report.py)."""
