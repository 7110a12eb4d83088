"""The soak run's summary, its verdict and its plot.

The verdict fails the run on: any wrong token (an answer `check.judge` failed for a different
greedy pick where the cold run's margin is real; bf16 end-anchor hits are recorded, not
judged), any unexpected error (a 5xx, a dropped connection or a failed cold run while the
server was not being killed, a hit for a fresh salt, a fault that did not end as it should), a
RAM-tier kind (tree links, end anchors) holding more bytes than its budget, or resident memory
growing faster than the bound at steady state (least-squares slope over the second half of the
longest life, judged when that window is at least `min_window_s` long).

Answers served from a restore the worker corrupted on purpose (the `restore_corruption` fault,
`RequestRecord.injected`) are the checker's proof, kept apart from everything above: each one
must have been flagged (`check.FLAGGED`: a wrong token, a length mismatch or drift beyond the
tolerance); the summary reports `corrupt_injected` and `corrupt_caught` side by side, and one
injected answer not flagged fails the run, as does a corruption fault that fired and never
injected (the proof did not happen).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.soak.check import FLAGGED
from benchmarks.soak.ledger import FaultRecord, RequestRecord


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        return None
    return 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def steady_rss(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """RSS slope over the second half of the longest life."""
    lives: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in samples:
        if s.get("rss"):
            lives[s["life"]].append((s["t"], float(s["rss"])))
    if not lives:
        return {"window_s": 0.0, "slope_mib_per_min": None}
    life, pts = max(lives.items(), key=lambda kv: kv[1][-1][0] - kv[1][0][0])
    mid = (pts[0][0] + pts[-1][0]) / 2
    window = [p for p in pts if p[0] >= mid]
    slope = slope_per_min([(t, v / 2**20) for t, v in window])
    return {"life": life, "window_s": round(window[-1][0] - window[0][0], 1) if window else 0.0,
            "samples": len(window), "slope_mib_per_min": slope,
            "first_mib": pts[0][1] / 2**20, "last_mib": pts[-1][1] / 2**20,
            "max_mib": max(v for _, v in pts) / 2**20}


def _checks(recs: list[RequestRecord]) -> dict[str, Any]:
    checked = [r for r in recs if r.check]
    c = Counter(r.check for r in checked)
    div = c["tie"] + c["wrong"]
    drifts = [r.max_drift for r in checked if r.max_drift is not None]
    return {"checked": len(checked), **{k: c[k] for k in ("same", "tie", "wrong", "length")},
            "divergence_rate": div / len(checked) if checked else None,
            "max_drift_nats": max(drifts) if drifts else None,
            "positions_compared": sum(r.compared for r in checked)}


def corruptions(requests: list[RequestRecord]) -> dict[str, Any]:
    """The checker against the injected corruptions: how many it flagged, and every one it did
    not (with what the check saw)."""
    injected = [r for r in requests if r.injected]
    caught = [r for r in injected if r.outcome == "unexpected_error" and r.cause in FLAGGED]
    missed = [r for r in injected if not (r.outcome == "unexpected_error" and r.cause in FLAGGED)]
    return {"injected": len(injected), "caught": len(caught),
            "by_cause": dict(Counter(r.cause for r in caught)),
            "restored_from": dict(Counter(r.restore.split(" ")[0] for r in injected)),
            "unflagged": [{"t": r.t, "life": r.life, "restore": r.restore, "outcome": r.outcome,
                           "cause": r.cause, "check": r.check, "margin": r.margin,
                           "max_drift": r.max_drift, "detail": r.detail} for r in missed]}


def summarize(requests: list[RequestRecord], faults: list[FaultRecord],
              samples: list[dict[str, Any]], *, wall_s: float, startups: list[float],
              kinds: tuple[str, ...], rss_bound_mib_per_min: float,
              min_window_s: float) -> dict[str, Any]:
    by_arm: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in requests:
        by_arm[r.arm.split(":")[0] if r.arm.startswith("fault:") else r.arm].append(r)
    corrupt = corruptions(requests)
    # everything below judges the cache: answers from an injected corruption are the
    # checker's proof instead (`corruptions`), not failures of the cache
    judged = [r for r in requests if not r.injected]
    cache_side = [r for r in judged if r.arm != "control"]
    failures: dict[str, Counter] = {"expected": Counter(), "unexpected": Counter()}
    for r in judged:
        if r.outcome != "ok":
            failures["expected" if r.outcome == "expected_error" else "unexpected"][r.cause] += 1
    ttft = {arm: [r.ttft_s for r in recs if r.ttft_s is not None and r.outcome == "ok"]
            for arm, recs in by_arm.items()}
    hit_ttft = [r.ttft_s for r in cache_side if r.ttft_s is not None and r.cached_tokens]
    miss_ttft = [r.ttft_s for r in requests
                 if r.ttft_s is not None and not r.cached_tokens and r.outcome == "ok"]
    fault_counts: dict[str, dict[str, int]] = {}
    for k in kinds:
        recs = [f for f in faults if f.kind == k]
        fault_counts[k] = {"fired": len(recs), "unexpected": sum(not f.expected for f in recs)}
    last = samples[-1] if samples else {}
    counters = {k: v for k, v in last.items() if k not in ("t", "life", "rss")}
    ram_peak = max((s.get("bytes_held.ram", 0) for s in samples), default=0)
    over_budget = sorted({k for s in samples for k, v in s.items()
                          if k.startswith("bytes_held.ram.")
                          and v > (s.get("budget_bytes" + k[len("bytes_held"):]) or float("inf"))})
    rss = steady_rss(samples)

    reasons: list[str] = []
    # a wrong token is an answer `judge` failed for one: a bf16 end-anchor hit's divergence is
    # recorded in its verdicts (anchor_hits) but not judged (check.judge: session-exact state,
    # no bf16 tolerance is both safe and tight), so it is no failure of the cache
    checks_cache = _checks(cache_side)
    wrong = sum(r.cause == "wrong_token" for r in judged)
    if wrong:
        reasons.append(f"{wrong} wrong token(s)")
    if corrupt["unflagged"]:
        reasons.append(f"{len(corrupt['unflagged'])} of {corrupt['injected']} answers served "
                       "from an injected restore corruption not flagged by the check")
    fired = sum(f.kind == "restore_corruption" for f in faults)
    if fired and not corrupt["injected"]:
        reasons.append(f"restore_corruption fired {fired} time(s) and never injected")
    n_unexpected = sum(failures["unexpected"].values())
    if n_unexpected:
        reasons.append(f"{n_unexpected} unexpected request error(s): "
                       f"{dict(failures['unexpected'])}")
    bad_faults = {k: v["unexpected"] for k, v in fault_counts.items() if v["unexpected"]}
    if bad_faults:
        reasons.append(f"faults that did not end as expected: {bad_faults}")
    if over_budget:
        reasons.append(f"bytes held above the budget in {over_budget}")
    gross = counters.get("in_place_gross", 0)
    if gross:
        reasons.append(f"{int(gross)} attention block(s) served in place held other rows than "
                       "the restored links stored (testing/in_place_check.py)")
    slope = rss["slope_mib_per_min"]
    rss["bound_mib_per_min"] = rss_bound_mib_per_min
    rss["judged"] = rss["window_s"] >= min_window_s and slope is not None
    if rss["judged"] and slope > rss_bound_mib_per_min:
        reasons.append(f"resident memory grew {slope:.1f} MiB/min at steady state "
                       f"(bound {rss_bound_mib_per_min} MiB/min)")
    return {
        "verdict": "fail" if reasons else "pass",
        "reasons": reasons,
        "corrupt_injected": corrupt["injected"],
        "corrupt_caught": corrupt["caught"],
        "corruption": corrupt,
        "wall_s": round(wall_s, 1),
        "lives": len(startups),
        "startup_s": [round(s, 1) for s in startups],
        "requests": {arm: {"sent": len(recs),
                           **Counter(r.outcome for r in recs)} for arm, recs in by_arm.items()},
        "failures": {k: dict(v) for k, v in failures.items()},
        "checks": {"cache_on": checks_cache, "cache_off_control": _checks(by_arm["control"]),
                   "corrupted_restores": _checks([r for r in requests if r.injected]),
                   "tree_hits": _checks([r for r in cache_side if r.hit_kind == "tree"]),
                   "anchor_hits": _checks([r for r in cache_side if r.hit_kind == "anchor"]),
                   "misses": _checks([r for r in cache_side if r.hit_kind == "none"])},
        "hit_requests": dict(Counter(r.hit_kind for r in cache_side if r.outcome == "ok")),
        "ttft_s": {"p50": {a: percentile(v, 0.5) for a, v in ttft.items()},
                   "p99": {a: percentile(v, 0.99) for a, v in ttft.items()},
                   "hits_p50": percentile(hit_ttft, 0.5), "hits_p99": percentile(hit_ttft, 0.99),
                   "misses_p50": percentile(miss_ttft, 0.5),
                   "misses_p99": percentile(miss_ttft, 0.99)},
        "faults": fault_counts,
        "cache": counters,
        "ram_bytes_peak": ram_peak,
        "budget_bytes": {k: v for smp in samples for k, v in smp.items()
                         if k.startswith("budget_bytes.")},
        "rss": rss,
    }


def plot(samples: list[dict[str, Any]], requests: list[RequestRecord],
         faults: list[FaultRecord], path: Path, title: str) -> None:
    """Four panels over time: resident memory, bytes held, cumulative counts, TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    lives: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for smp in samples:
        lives[smp["life"]].append(smp)

    def lines(ax, value, label: str, color: str) -> None:
        """One segment per life (no line across a restart's gap)."""
        for n, (_, pts) in enumerate(sorted(lives.items())):
            ax.plot([p["t"] / 60 for p in pts], [value(p) for p in pts], color=color,
                    label=label if n == 0 else None)

    lines(axes[0], lambda p: (p.get("rss") or 0) / 2**20, "server RSS (process tree)", "C0")
    axes[0].set_ylabel("MiB")
    axes[0].legend(loc="upper left")
    for key, label, color in (("bytes_held.ram.tree", "RAM tier, tree links", "C0"),
                              ("bytes_held.ram.anchor", "RAM tier, end anchors", "C2"),
                              ("bytes_held.disk", "disk tier, every kind", "C1")):
        if any(key in p for p in samples):
            lines(axes[1], lambda p, k=key: p.get(k, 0) / 2**20, label, color)
    axes[1].set_ylabel("MiB held")
    axes[1].legend(loc="upper left")
    ax = axes[2]
    for n, (key, label) in enumerate((("evictions", "evictions"), ("hits", "hits"),
                                      ("preemptions", "vLLM preemptions"))):
        lines(ax, lambda p, k=key: sum(v for name, v in p.items()
                                       if name == k or name.startswith(k + ".")),
              label, f"C{n}")
    done = sorted(r.t / 60 for r in requests if r.outcome == "ok")
    ax.plot(done, range(1, len(done) + 1), color="C3", label="requests served")
    ax.set_ylabel("cumulative")
    ax.legend(loc="upper left")
    ax = axes[3]
    for arm, color in (("cache", "C0"), ("tenant", "C2"), ("control", "C1")):
        pts = [(r.t / 60, r.ttft_s) for r in requests if r.arm == arm and r.ttft_s]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=6, color=color, label=f"TTFT {arm}")
    ax.set_ylabel("s")
    ax.set_yscale("log")
    ax.set_xlabel("minutes")
    ax.legend(loc="upper left")
    for f in faults:
        for a in axes:
            a.axvline(f.t / 60, color="red" if f.kind == "kill_restart" else "grey",
                      alpha=0.5 if f.kind == "kill_restart" else 0.15, lw=0.8)
    fig.suptitle(title + "  (grey: faults, red: kill -9 + restart)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def replot(path: Path) -> Path:
    """Draw the plot of a written report again (`python -m benchmarks.soak.report FILE`)."""
    data = json.loads(path.read_text())
    reqs = msgspec.convert(data["requests"], list[RequestRecord])
    faults = msgspec.convert(data["faults"], list[FaultRecord])
    wall = data["summary"]["wall_s"]
    out = path.with_suffix(".png")
    plot(data["samples"], reqs, faults, out,
         f"{data['model']} ({data['dtype']}), seed {data['settings']['seed']}, "
         f"{wall / 60:.1f} min")
    return out


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:]:
        print(replot(Path(name)))
