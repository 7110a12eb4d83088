"""A grid larger than one prefill step (vLLM's `max_num_batched_tokens`) is fitted to the step,
so the cache still captures and serves; without the fit nothing is ever cached.

A link is captured only where one prefill step covers a whole segment (a step the token budget
cut short runs off the segmentation). vLLM's CPU server defaults to 2048 batched tokens, the
default grid, and a smaller `--max-num-batched-tokens` used to leave every prompt uncached
without a word. On vLLM's real scheduler without a model (tests/harness/engine.py).
"""

from __future__ import annotations

import logging

from tests.harness.engine import HarnessEngine, cache_stats
from vllm_hybridcache.adapter import startup
from vllm_hybridcache.adapter.startup import grid_for_step

GRID = 256          # the setting
STEP = 192          # max_num_batched_tokens: three 64-token blocks
A = [100 + (i * 7) % 3000 for i in range(3 * STEP + 20)]
B = A[: 2 * STEP] + [50 + (i * 13) % 3000 for i in range(70)]


def test_grid_for_step():
    assert grid_for_step(2048, 4096) == 2048
    assert grid_for_step(2048, 2048) == 2048
    assert grid_for_step(2048, 1024) == 1024
    assert grid_for_step(2048, 1000) == 960      # a multiple of 64 within the step
    assert grid_for_step(2048, None) == 2048
    assert grid_for_step(256, 63) == 256          # no segment fits: kept (nothing cached)


def _engine(**kw) -> HarnessEngine:
    return HarnessEngine({"grid": GRID}, max_num_batched_tokens=STEP, **kw)


def test_a_grid_larger_than_the_step_is_fitted_and_hits_equal_cold(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_hybridcache"):
        e = _engine()
    assert e.connector._sched.segmentation.grid == STEP
    assert any("larger than one prefill step" in r.getMessage() for r in caplog.records)
    a_cold, b_cold = _engine().run(A), _engine().run(B)
    first = e.run(A)
    assert first.cached == 0 and cache_stats(e)["links"] == 3
    b, a = e.run(B), e.run(A)
    assert (b.cached, a.cached) == (2 * STEP, 3 * STEP)
    for warm, cold in ((b, b_cold), (a, a_cold)):
        assert warm.tokens == cold.tokens and warm.state is not None
        assert warm.state == cold.state


def test_negative_control_without_the_fit_nothing_is_cached(monkeypatch):
    monkeypatch.setattr(startup, "grid_for_step", lambda grid, step: grid)
    e = _engine()
    assert e.connector._sched.segmentation.grid == GRID
    e.run(A)
    assert cache_stats(e)["links"] == 0
    assert e.run(A).cached == 0


def test_a_grid_within_the_step_is_left_alone():
    e = HarnessEngine({"grid": 128}, max_num_batched_tokens=STEP)
    assert e.connector._sched.segmentation.grid == 128
