"""The paired replay harness (benchmarks/replay_ab.py): what a replay reports, how a family is
judged against the baseline, that uncounted warm-up rounds stay out of the figures, and the
page. Fake replays, no server."""

from __future__ import annotations

import contextlib
import json

import pytest

from benchmarks import report as rep
from benchmarks.ab import ABRun, alternate
from benchmarks.replay import RequestResult
from benchmarks.replay_ab import markdown, meets_goal, run_family, sample
from benchmarks.traces import generate


def _summary(errors: int = 0) -> rep.SystemSummary:
    ok = [RequestResult(index=i, session="s", turn=i, wave=i, prompt_tokens=100,
                        cached_tokens=40, ideal_tokens=60, ttft_s=0.01 * (i + 1), e2e_s=0.1)
          for i in range(3)]
    bad = [RequestResult(index=9, session="s", turn=9, wave=9, error="boom")] * errors
    return rep.summarize(ok + bad, 1.5, None)


def test_a_replay_reports_its_share_ttft_time_and_cpu():
    got = sample(_summary(), 3.25)
    assert got["cached_pct"] == pytest.approx(40.0)
    assert got["ttft_p50_ms"] == pytest.approx(20.0)
    assert got["e2e_s"] == 1.5 and got["server_cpu_s"] == 3.25
    with pytest.raises(ValueError, match="1 of 4 requests failed"):
        sample(_summary(errors=1), 3.25)  # a failed request is never averaged in


def _run(ours: dict[str, list[float]], native: dict[str, list[float]]) -> ABRun:
    metrics = set(ours)
    return alternate(("ours", "native"), len(ours["ttft_p50_ms"]),
                     lambda arm, r: {m: (ours if arm == "ours" else native)[m][r]
                                     for m in metrics},
                     read_load=None, sampler=contextlib.nullcontext)  # no load read


def _metrics(cached: float, ttft: list[float], cpu: list[float]) -> dict[str, list[float]]:
    n = len(ttft)
    return {"cached_pct": [cached] * n, "ttft_p50_ms": ttft, "ttft_p95_ms": ttft,
            "e2e_s": [1.0] * n, "server_cpu_s": cpu}


def test_the_goal_is_judged_on_paired_ratios_and_the_cached_share():
    native = _metrics(50.0, [100, 300, 100], [5.0, 15.0, 5.0])
    # ours 0.9x native in every round, although its median (270) is above native's first
    # and third rounds: the rounds' own ratios decide
    ours = _metrics(60.0, [90, 270, 90], [4.5, 13.5, 4.5])
    ok, why = meets_goal(_run(ours, native), "ours", "native")
    assert ok and why == []
    # negative controls: 2 of 3 rounds 1.1x slower fails on TTFT; the same share fails on
    # caching
    slower = _metrics(60.0, [110, 330, 90], [4.5, 13.5, 4.5])
    ok, why = meets_goal(_run(slower, native), "ours", "native")
    assert not ok and why == ["ttft_p50_ms paired 1.100x"]
    same_share = _metrics(50.0, [90, 270, 90], [4.5, 13.5, 4.5])
    ok, why = meets_goal(_run(same_share, native), "ours", "native")
    assert not ok and why == ["cached 50.0% <= 50.0%"]


def test_warmup_rounds_run_first_and_are_not_counted(capsys):
    trace = generate("chat-ui", "ci", 0)
    calls = []

    def one(tr, system):
        calls.append(system)
        first = len(calls) <= 2  # the warm-up round: slow, must not count
        return {"cached_pct": 50.0, "ttft_p50_ms": 1000.0 if first else 10.0,
                "ttft_p95_ms": 10.0, "e2e_s": 1.0, "server_cpu_s": 1.0}

    run = run_family(trace, ["ours", "native"], 2, 1, one, load_wait_s=0)
    assert len(calls) == 6
    assert run.values("ttft_p50_ms", "ours") == [10.0, 10.0]
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["counted"] for x in lines] == [False, False, True, True, True, True]
    assert {x["family"] for x in lines} == {"chat-ui"}


def test_the_page_counts_the_families_that_meet_the_goal_and_keeps_every_round():
    native = _metrics(50.0, [100, 100, 100], [5.0, 5.0, 5.0])
    good = _run(_metrics(60.0, [90, 90, 90], [4.5, 4.5, 4.5]), native)
    bad = _run(_metrics(60.0, [120, 120, 90], [4.5, 4.5, 4.5]), native)
    meta = {"model": "m", "size": "ci", "rounds": 3, "warmup_rounds": 1,
            "settle_s": 2.0, "started_utc": "t", "command": "c", "commit": "abc",
            "host": "h"}
    page = markdown({"chat-ui": good, "concurrent": bad}, "ours", "native", meta)
    assert "`c` (commit abc, t; h). 3 counted rounds after 1 uncounted" in page
    assert "load average" not in page  # none was read (the fake rounds read no load)
    assert "**1 of 2 families meet it.**" in page
    assert "| chat-ui | **ours / native** | +10.0 pts | 0.90x |" in page
    assert "NOT met: ttft_p50_ms paired 1.200x" in page
    assert "<!-- concurrent: cached_pct ours [60.0, 60.0, 60.0]" in page
