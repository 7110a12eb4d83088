"""End to end: `python -m benchmarks.run` replays the CI-size traces against one stock vLLM
server (native prefix caching) of qwen3-next-tiny, and the report is complete and consistent.

Two traces go through the same server, so the cache reset between traces is exercised too.
No number is hard-coded: every check relates the report to the trace or to itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import report as rep
from benchmarks.ideal import PromptTokenizer
from benchmarks.run import main as run_main
from benchmarks.traces import generate

FAMILIES = ("coding-agent", "sub-agents")


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory, embedded_model) -> tuple[Path, int]:
    embedded_model("qwen3-next-tiny")
    out = tmp_path_factory.mktemp("bench")
    status = run_main(["--model", "qwen3-next-tiny", "--trace", ",".join(FAMILIES),
                       "--size", "ci", "--systems", "native", "--max-tokens", "8",
                       "--load-wait", "0", "--out", str(out), "--log-dir", str(out / "logs")])
    return out, status


@pytest.mark.slow
def test_run_succeeds_and_writes_every_file(bench_out) -> None:
    out, status = bench_out
    assert status == 0
    index = (out / "README.md").read_text()
    for family in FAMILIES:
        stem = f"qwen3-next-tiny-{family}-ci"
        for suffix in (".json", ".md", "-cached.png", "-ttft.png"):
            path = out / f"{stem}{suffix}"
            assert path.exists() and path.stat().st_size > 0, path
        assert f"{stem}.md" in index
        md = (out / f"{stem}.md").read_text()
        assert "| native |" in md and "--enable-prefix-caching" in md


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_report_is_complete_and_consistent(bench_out, family: str, embedded_model) -> None:
    out, _ = bench_out
    report = rep.load(out / f"qwen3-next-tiny-{family}-ci.json")
    trace = generate(family, "ci", 0)
    assert report.trace["digest"] == trace.digest()
    assert report.trace["requests"] == len(trace.requests)
    assert report.command.startswith("python -m benchmarks.run")
    [run] = report.systems
    assert run.name == "native" and run.error is None and run.started_by_runner
    assert run.cache_state == ("fresh server" if family == FAMILIES[0] else "reset")
    assert [(r.session, r.turn, r.wave) for r in run.requests] == [
        (q.session, q.turn, q.wave) for q in trace.requests]

    tok = PromptTokenizer(embedded_model("qwen3-next-tiny"))
    for r, q in zip(run.requests, trace.requests, strict=True):
        assert r.error is None
        assert r.prompt_tokens == r.local_prompt_tokens == len(
            tok.prompt_ids(trace.messages(q), trace.tools(q)))
        assert r.prompt_ids_match is True
        assert r.completion_tokens == report.settings["max_tokens"]
        assert r.cached_tokens is not None and 0 <= r.cached_tokens <= r.ideal_tokens
        assert 0 <= r.ideal_tokens <= r.prompt_tokens - 1
        assert r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s <= r.e2e_s
    assert run.requests[0].cached_tokens == 0 and run.requests[0].ideal_tokens == 0

    m = run.summary
    assert m is not None and m.errors == 0 and m.requests == len(trace.requests)
    assert m.prompt_tokens == sum(r.prompt_tokens for r in run.requests) \
        == report.trace["prompt_tokens"]
    assert m.cached_tokens == sum(r.cached_tokens for r in run.requests)
    assert m.ideal_tokens == sum(r.ideal_tokens for r in run.requests) > 0
    assert m.cached_fraction == pytest.approx(m.cached_tokens / m.prompt_tokens)
    assert m.ideal_fraction == pytest.approx(m.ideal_tokens / m.prompt_tokens)
    assert m.ttft_p50_ms <= m.ttft_p95_ms
    assert m.e2e_s >= max(r.e2e_s for r in run.requests)
    assert m.cached_above_ideal == 0 and m.prompt_mismatches == 0
    assert m.peak_snapshot_bytes is None and not run.cache_stats_route, "stock vLLM: n/a"
