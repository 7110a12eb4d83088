"""The README headline is read from one run's results: both systems of every family, and no
family of another run mixed in."""

from __future__ import annotations

import json

from benchmarks import headline


def _result(folder, family: str, command: str, cached: dict[str, float]) -> None:
    systems = [{"name": name, "error": None, "server_cpu_s": 2.0 + i,
                "summary": {"cached_fraction": c, "ttft_p50_ms": 50.0 * (i + 1), "e2e_s": 1.0}}
               for i, (name, c) in enumerate(cached.items())]
    (folder / f"m-{family}-ci.json").write_text(json.dumps({
        "command": command, "started_utc": "2026-12-02T00:00:00Z", "git_commit": "abc" * 5,
        "systems": systems}))


def test_one_run_both_systems(tmp_path):
    _result(tmp_path, "coding-agent", "run A", {"ours": 0.7, "native": 0.6})
    _result(tmp_path, "chat-ui", "run A", {"ours": 0.5})  # native missing: left out
    rows, commands = headline.load("m", "ci", ("ours", "native"), tmp_path)
    assert list(rows) == ["coding-agent"] and len(commands) == 1
    text = headline.table(rows, ("ours", "native"))
    assert "| coding-agent | 70.0% / 60.0% | 50 / 100 (0.50x) | 1.00 / 1.00 | 2.00 / 3.00 |" in text
    # a family from another run is seen as such (main() then refuses to plot them together)
    _result(tmp_path, "sub-agents", "run B", {"ours": 0.7, "native": 0.6})
    assert len(headline.load("m", "ci", ("ours", "native"), tmp_path)[1]) == 2
