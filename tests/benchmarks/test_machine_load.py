"""The load a benchmark ran under is sampled, waited on and flagged (issue 33: a run on a busy
machine is flagged, never published as comparable)."""

from __future__ import annotations

import itertools
import threading

from benchmarks import report as rep
from benchmarks.machine_load import LoadSampler, wait_for_quiet


def test_the_sampler_keeps_the_peak_seen_during_the_block() -> None:
    values = iter([0.5, 3.5, 1.0])
    drained = threading.Event()

    def read() -> float:
        value = next(values, None)
        if value is None:
            drained.set()
            return 1.0
        return value

    with LoadSampler(interval_s=0.001, read=read) as s:
        assert drained.wait(10.0), "the sampler stopped reading"
    assert s.peak == 3.5, "the peak in the middle of the block, not the last reading"


def test_waiting_stops_when_quiet_or_at_the_deadline() -> None:
    now = itertools.count()
    loads = iter([4.0, 3.0, 1.5])
    slept: list[float] = []
    got = wait_for_quiet(2.0, 100.0, read=lambda: next(loads), sleep=slept.append,
                         clock=lambda: float(next(now)))
    assert got == 1.5 and len(slept) == 2
    # never quiet: it gives up at the deadline and returns the load it last saw
    clock = iter([0.0, 1.0, 6.0, 11.0, 16.0])
    got = wait_for_quiet(2.0, 10.0, read=lambda: 5.0, sleep=lambda s: None,
                         clock=lambda: next(clock))
    assert got == 5.0
    # no wait asked for: one read, no sleep
    assert wait_for_quiet(2.0, 0.0, read=lambda: 9.0, sleep=slept.append) == 9.0


def test_a_loaded_run_is_flagged_in_the_index(tmp_path) -> None:
    def run(name: str, loads: list[float], peak: float | None) -> rep.SystemRun:
        return rep.SystemRun(name=name, description="d", load_avg=loads, load_max=peak)

    quiet, busy = run("native", [0.4, 0.9], 1.2), run("ours", [0.4, 0.9], 5.3)
    assert not rep.loaded(quiet) and rep.loaded(busy)
    assert rep.loaded(run("x", [2.5, 0.1], None)), "a load before the replay counts too"
    assert not rep.loaded(run("x", [], None)), "nothing recorded: nothing to flag"
    report = rep.Report(
        schema=rep.SCHEMA_VERSION, command="c", started_utc="2026-12-02T00:00:00Z",
        finished_utc="2026-12-02T00:01:00Z", git_commit="0123456789abcdef", vllm_version=None,
        host={"summary": "h"}, model={"name": "m", "path": "/m", "served_name": "m"},
        trace={"family": "chat-ui", "size": "ci", "seed": 0, "description": "d",
               "digest": "x", "requests": 0, "waves": 0, "sessions": 0, "prompt_tokens": 0,
               "max_prompt_tokens": 0},
        settings={"history": "scripted", "max_tokens": 4, "tool_choice": "none",
                  "max_model_len": 8192}, systems=[quiet, busy])
    rep.write(report, tmp_path)
    index = rep.write_index(tmp_path).read_text()
    native = next(line for line in index.splitlines() if "| native |" in line)
    ours = next(line for line in index.splitlines() if "| ours |" in line)
    assert "| 01234567 | 2026-12-02 | 1.2 |" in native and "loaded" not in native
    assert "| 5.3 (loaded) |" in ours
    md = (tmp_path / "m-chat-ui-ci.md").read_text()
    assert "at most 5.3 during (above 2.0" in md
