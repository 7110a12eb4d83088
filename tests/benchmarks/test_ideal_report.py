"""The ideal-prefix computation, the report's arithmetic and files, the runner's CLI parsing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from benchmarks import report as rep
from benchmarks.ideal import common_prefix, ideal_cached, to_template
from benchmarks.replay import RequestResult, headline_bytes, server_root, snapshot_bytes
from benchmarks.run import main as run_main
from benchmarks.run import parse_base_urls


def test_common_prefix() -> None:
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 3, 4, 5])) == 4
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, np.array([], dtype=np.int64)) == 0
    assert common_prefix(a, np.array([7])) == 0


def _naive(waves, prompts, seen):
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for j, s in enumerate(seen):
            if waves[j] < waves[i]:
                k = 0
                while k < min(len(p), len(s)) and p[k] == s[k]:
                    k += 1
                best = max(best, k)
        out.append(min(best, max(0, len(p) - 1)))
    return out


def test_ideal_matches_brute_force_on_random_families_of_prompts() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 8)
        base = [rng.randint(0, 3) for _ in range(12)]
        prompts = [base[: rng.randint(0, 12)] + [rng.randint(0, 3)
                                                 for _ in range(rng.randint(0, 6))]
                   for _ in range(n)]
        seen = [p + [rng.randint(0, 3) for _ in range(rng.randint(0, 4))] for p in prompts]
        waves = sorted(rng.randint(0, 4) for _ in range(n))
        assert ideal_cached(waves, prompts, seen) == _naive(waves, prompts, seen)


def test_ideal_rules() -> None:
    head = [5, 6, 7, 8]
    # same wave: no credit; earlier wave: credit; identical prompt: capped at len - 1
    assert ideal_cached([0, 0], [head, head], [head, head]) == [0, 0]
    assert ideal_cached([0, 1], [head, head], [head, head]) == [0, 3]
    # the answer counts: the next prompt continues what the server generated
    assert ideal_cached([0, 1], [[1, 2], [1, 2, 3, 4, 9]], [[1, 2, 3, 4], [1, 2, 3, 4, 9]]) \
        == [0, 4]
    with pytest.raises(ValueError):
        ideal_cached([0], [[1]], [])


def test_to_template_matches_what_vllm_hands_the_template() -> None:
    msgs = [{"role": "assistant", "content": "", "reasoning": "why",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "grep", "arguments": '{"pattern": "x"}'}}]}]
    out = to_template(msgs)
    assert out[0]["reasoning_content"] == "why" and "reasoning" not in out[0]
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"pattern": "x"}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"pattern": "x"}', "no mutation"


def test_snapshot_bytes_from_the_plugin_stats() -> None:
    stats = {"tiers": {"ram": {"bytes_held": 1000, "links": 3}, "disk": {"bytes_held": 50}},
             "engines": 1}
    assert snapshot_bytes(stats) == {"ram": 1000, "disk": 50}
    assert headline_bytes(snapshot_bytes(stats)) == 1000
    assert snapshot_bytes({"bytes_held": 7}) == {"total": 7}
    assert headline_bytes(snapshot_bytes({"error": "x"})) is None
    assert server_root("http://h:1/v1/") == "http://h:1"


def _result(i: int, prompt: int, cached: int | None, ideal: int, ttft: float,
            error: str | None = None) -> RequestResult:
    return RequestResult(index=i, session="s", turn=i, wave=i, prompt_tokens=prompt,
                         local_prompt_tokens=prompt, cached_tokens=cached, ideal_tokens=ideal,
                         completion_tokens=4, ttft_s=ttft, e2e_s=ttft + 0.1,
                         prompt_ids_match=True, error=error)


def test_summary_is_token_weighted_and_ignores_failed_requests() -> None:
    results = [_result(0, 100, 0, 0, 0.2), _result(1, 300, 200, 250, 0.1),
               _result(2, 999, None, 0, 9.0, error="HTTP 500")]
    m = rep.summarize(results, wall_s=1.5, peak_bytes=None)
    assert (m.requests, m.errors, m.prompt_tokens, m.cached_tokens) == (3, 1, 400, 200)
    assert m.cached_fraction == pytest.approx(0.5)
    assert m.ideal_fraction == pytest.approx(250 / 400)
    assert m.cached_of_ideal == pytest.approx(200 / 250)
    assert m.ttft_p50_ms == pytest.approx(150.0)
    assert m.cached_above_ideal == 0 and m.prompt_mismatches == 0
    assert rep.summarize([_result(0, 10, 9, 5, 0.1)], 1.0, None).cached_above_ideal == 1


def _report(systems: list[rep.SystemRun]) -> rep.Report:
    return rep.Report(schema=rep.SCHEMA_VERSION, command="python -m benchmarks.run",
                      started_utc="a", finished_utc="b", git_commit=None, vllm_version=None,
                      host={"summary": "h"},
                      model={"name": "m", "path": "/m", "served_name": "m"},
                      trace={"family": "chat-ui", "size": "ci", "seed": 0, "description": "d",
                             "digest": "x", "requests": 2, "waves": 2, "sessions": 1,
                             "prompt_tokens": 400, "max_prompt_tokens": 300},
                      settings={"history": "scripted", "max_tokens": 4, "tool_choice": "none",
                                "max_model_len": 8192},
                      systems=systems)


def test_report_files_and_index(tmp_path) -> None:
    results = [_result(0, 100, 0, 0, 0.2), _result(1, 300, 200, 250, 0.1)]
    ok = rep.SystemRun(name="native", description="d", requests=results,
                       summary=rep.summarize(results, 1.0, None))
    failed = rep.SystemRun(name="ours", description="d", error="ServerError: exited\nlog")
    report = _report([ok, failed])
    paths = rep.write(report, tmp_path)
    for p in paths.values():
        assert p.exists() and p.stat().st_size > 0
    assert rep.load(paths["json"]) == report
    md = paths["markdown"].read_text()
    assert "| native | 2 | 0 | 400 | 200 | 50.0% | 62.5% |" in md
    assert "| ours |" in md and "ServerError: exited" in md
    index = rep.write_index(tmp_path).read_text()
    assert index.count("m-chat-ui-ci.md") == 2


def test_base_url_parsing() -> None:
    assert parse_base_urls(["http://h:8000"], ["ours"]) == {"ours": "http://h:8000"}
    assert parse_base_urls(["native=http://a", "ours=http://b"], ["native", "ours"]) == {
        "native": "http://a", "ours": "http://b"}
    with pytest.raises(SystemExit):
        parse_base_urls(["http://h:8000"], ["native", "ours"])
    with pytest.raises(SystemExit):
        parse_base_urls(["nocache=http://h"], ["ours"])


def test_absent_microbenchmark_fails_clearly(capsys) -> None:
    assert run_main(["--micro", "nonexistent"]) == 2
    assert "unknown microbenchmark" in capsys.readouterr().err
    assert run_main(["--list"]) == 0
    assert "coding-agent" in capsys.readouterr().out


def test_unknown_names_exit_before_starting_anything() -> None:
    for args in (["--systems", "vllm9"], ["--trace", "nope"], ["--size", "xxl"]):
        with pytest.raises(SystemExit, match="unknown"):
            run_main(args)


def test_feature_ablation_systems_switch_features_through_the_environment():
    """`ours-grid` and `ours-msgend` are `ours` with features off via the plugin's env keys;
    `ours-copy` is `ours` with attention K/V in place off (copied), `ours-pinned` with the CPU
    attention pin (process environment only, the settings unchanged)."""
    from benchmarks.servers import SYSTEMS, ServerSettings, server_argv, server_env
    from vllm_hybridcache.config import load_settings

    settings = ServerSettings(model_path="/m", served_name="m", max_model_len=4096)
    argvs = {n: server_argv(SYSTEMS[n], settings, 8000)[1:] for n in ("ours", "ours-grid",
                                                                       "ours-msgend")}
    assert argvs["ours"] == argvs["ours-grid"] == argvs["ours-msgend"]
    full = load_settings(environ=server_env(settings, SYSTEMS["ours"]))
    grid = load_settings(environ=server_env(settings, SYSTEMS["ours-grid"]))
    msgend = load_settings(environ=server_env(settings, SYSTEMS["ours-msgend"]))
    assert full.session_anchors > 0 and full.message_end_ids == ()
    assert grid.session_anchors == 0 and grid.message_end_ids == (-1,)
    assert msgend.session_anchors == 0 and msgend.message_end_ids == ()
    copy = load_settings(environ=server_env(settings, SYSTEMS["ours-copy"]))
    assert server_argv(SYSTEMS["ours-copy"], settings, 8000)[1:] == argvs["ours"]
    assert full.attention_in_place and not copy.attention_in_place
    pinned = server_env(settings, SYSTEMS["ours-pinned"])     # fine mode for Qwen3-Next on CPU
    assert server_argv(SYSTEMS["ours-pinned"], settings, 8000)[1:] == argvs["ours"]
    assert pinned["VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT"] == "1"
    assert load_settings(environ=pinned) == full


def test_the_quantized_system_serves_the_run_models_twin(monkeypatch):
    """`ours-w8a8` serves `<model>-w8a8` of whichever model the run is on (the embedded twin,
    written on first use: resolved here without writing it)."""
    import vllm_hybridcache.models as models
    from benchmarks.servers import SYSTEMS, ServerSettings, server_argv

    asked = []
    monkeypatch.setattr(models, "ensure_model", lambda name: asked.append(name) or f"/x/{name}")
    for model in ("qwen3-next-tiny", "flash-next-tiny"):
        settings = ServerSettings(model_path=f"/m/{model}", served_name="served",
                                  max_model_len=4096, model_name=model)
        argv = server_argv(SYSTEMS["ours-w8a8"], settings, 8000)
        assert argv[2] == f"/x/{model}-w8a8"
        assert server_argv(SYSTEMS["ours"], settings, 8000)[2] == f"/m/{model}"  # control
    assert asked == ["qwen3-next-tiny-w8a8", "flash-next-tiny-w8a8"]


def test_the_plugin_s_overhead_over_a_replay_and_in_the_report(tmp_path) -> None:
    """The route's cumulative `overhead` at the end less at the start (another trace ran on
    the same server before), its share, and where the report shows it."""
    from benchmarks.replay import overhead_delta

    first = {"scheduler_s": {"lookup": 1.0, "plan": 2.0}, "worker_s": {"save": 1.0},
             "busy_s": 10.0, "steps": 5}
    last = {"scheduler_s": {"lookup": 1.5, "plan": 2.5}, "worker_s": {"save": 2.0},
            "busy_s": 29.0, "steps": 15}
    d = overhead_delta(first, last)
    assert d["scheduler_s"] == {"lookup": 0.5, "plan": 0.5} and d["worker_s"] == {"save": 1.0}
    assert (d["busy_s"], d["steps"]) == (19.0, 10)
    assert d["share"] == pytest.approx(2.0 / 20.0)
    # negative control: the cumulative totals would give another share
    assert overhead_delta({}, last) is None and d["share"] != pytest.approx(5.0 / 34.0)

    results = [_result(0, 100, 0, 0, 0.2), _result(1, 300, 200, 250, 0.1)]
    ours = rep.SystemRun(name="ours", description="d", requests=results, overhead=d,
                         summary=rep.summarize(results, 1.0, None))
    native = rep.SystemRun(name="native", description="d", requests=results,
                           summary=rep.summarize(results, 1.0, None))
    paths = rep.write(_report([ours, native]), tmp_path)
    md = paths["markdown"].read_text()
    ours_row = next(line for line in md.splitlines() if line.startswith("| ours |"))
    native_row = next(line for line in md.splitlines() if line.startswith("| native |"))
    assert ours_row.endswith("| 10.0% |") and native_row.endswith("| n/a |")
    assert "worker save 1.000 s" in md
    index = rep.write_index(tmp_path).read_text()
    assert "| plugin share |" in index and "| 10.0% |" in index
