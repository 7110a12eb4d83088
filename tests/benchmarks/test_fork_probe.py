"""The fork probe's pure parts (benchmarks/fork_probe.py): the prompts make forks of one head
that share exactly the head and its first generated token, the usage page is parsed, and the
summary compares ours to native and says whether issue 33's goal is met."""

from __future__ import annotations

from benchmarks.fork_probe import (
    fork_prompts,
    head_tokens,
    markdown,
    parse_usage,
    summarize,
)


def test_forks_share_the_head_and_its_first_token_and_nothing_more():
    head = head_tokens(64)
    assert head == head_tokens(64) and head != head_tokens(64, seed=1)
    forks = fork_prompts(head, 7, 4, 30) + fork_prompts(head, 7, 4, 30, wave=1)
    assert all(f[:65] == [*head, 7] and len(f) == 95 for f in forks)
    # every two forks (in a wave and across waves) part right after the shared 65 tokens
    suffixes = {f[65] for f in forks}
    assert len(suffixes) == len(forks)


PAGE = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.125
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:kv_cache_usage_perc_other{engine="0"} 0.9
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_the_usage_is_the_largest_engine_sample_of_that_metric_only():
    assert parse_usage(PAGE) == 0.25
    assert parse_usage("vllm:num_requests_running 3.0\n") is None   # negative control


def _wave(n, peak, cached):
    return {"sessions": n, "peak_usage": peak, "cached": cached, "ttft_s": [0.1] * n}


def test_summary_ratio_and_goal():
    results = {
        "native": {"waves": [_wave(4, 0.10, [6144] * 4), _wave(8, 0.20, [6144] * 8)]},
        "ours": {"waves": [_wave(4, 0.105, [6144] * 4), _wave(8, 0.50, [6144] * 7 + [0])]},
    }
    rows = summarize(results)
    assert [r["sessions"] for r in rows] == [4, 8]
    assert abs(rows[0]["ratio"] - 1.05) < 1e-9 and rows[0]["goal_met"]
    # negative control: 2.5x native and one miss fail the goal
    assert abs(rows[1]["ratio"] - 2.5) < 1e-9 and not rows[1]["goal_met"]
    assert rows[1]["ours_hits"] == 7
    table = markdown(rows)
    assert "| 4 | 10.00 | 10.50 | 1.05 | 4/4 | 4/4 |" in table
    assert "| 8 | 20.00 | 50.00 | 2.50 | 8/8 | 7/8 |" in table
