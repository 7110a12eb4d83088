"""The segmentation benchmark's offline simulation: hits and step counts on hand-made prompts."""

from __future__ import annotations

from benchmarks.segmentation_bench import Setting, TracePrompts, parse_settings, simulate

END = 7  # stands in for <|im_end|>


def _prompts() -> TracePrompts:
    head = [1] * 299 + [END]                       # a message end at 300
    a = head + [2] * 500                           # 800 tokens
    b = head + [3] * 100                           # shares the head only
    c = a + [4] * 10                               # extends a
    return TracePrompts("hand", waves=[0, 1, 2], prompts=[a, b, c], ideal=[0, 300, 800])


def test_parse_settings():
    assert parse_settings("512/256, 2048/off") == [Setting(512, 256), Setting(2048, None)]


def test_hits_follow_the_cuts_of_earlier_waves():
    tp = _prompts()
    # grid 256, message ends 32 after the previous cut: a cuts at 256, 300, 512, 768
    row = simulate(tp, Setting(256, 32), END, step_tokens=2048)
    assert row.cached_tokens == 300 + 768          # b at the message end, c at a's last cut
    assert row.ideal_tokens == 1100
    # a: 5 steps (256, 300, 512, 768, 800); b: 2 (256, 300) + 1 (400); c: 4 cuts + the rest
    assert row.cold_steps == 5 + 3 + 5
    assert row.stock_steps == 3
    grid_only = simulate(tp, Setting(256, None), END, step_tokens=2048)
    assert grid_only.cached_tokens == 256 + 768
    # M = 64: the message end is only 44 tokens past the grid cut at 256, so no cut there
    assert simulate(tp, Setting(256, 64), END, step_tokens=2048).cached_tokens == 256 + 768


def test_same_wave_requests_never_share():
    tp = _prompts()
    same = TracePrompts("hand", waves=[0, 0, 0], prompts=tp.prompts, ideal=[0, 0, 0])
    assert simulate(same, Setting(256, 32), END, step_tokens=2048).cached_tokens == 0


def test_the_token_budget_splits_long_steps():
    tp = TracePrompts("hand", waves=[0], prompts=[[1] * 5000], ideal=[0])
    row = simulate(tp, Setting(4096, None), END, step_tokens=2048)
    assert row.cold_steps == 3 and row.stock_steps == 3   # 2048, 4096, 5000
