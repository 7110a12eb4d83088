"""The same exactness contract on Flash-Next (flash-next-tiny): GDN state and conv tail, PLE
conv state and n-gram context, QSA K/V rows. The connector learns them from vLLM's KV-cache
groups; no Flash-Next code is involved."""

from __future__ import annotations

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_exactness import GRID, A, B, clear, run
from vllm_hybridcache.testing.instrumentation import instrument

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(inproc, embedded_model):
    # The defaults' forward (split-invariant where `auto` turns it on: bf16 on a CPU host
    # without a bf16 GEMM of its own), in step segmentation (`inner_captures` off): these
    # tests count hits at grid cuts; fine mode's links are checked in test_fine_cuts.py.
    with connector_engine(embedded_model("flash-next-tiny"),
                          extra={"grid": GRID, "inner_captures": False}) as engine:
        instrument(engine)          # state probes: the "state" of run()
        yield engine


def test_flash_next_parts_come_from_kv_cache_groups(llm):
    sched, _ = engine_parts(llm)
    layout = sched.parts.layout
    assert sched.active
    assert len(layout.sections) > 6 and len(layout.views) >= 1   # GDN + PLE sections, QSA rows


def test_flash_next_warm_equals_cold(llm):
    clear(llm)
    a_cold = run(llm, A)
    clear(llm)
    b_cold = run(llm, B)
    clear(llm)
    run(llm, A)
    b_warm = run(llm, B)
    a_warm = run(llm, A)
    assert (b_warm["cached"], a_warm["cached"]) == (2 * GRID, 3 * GRID)
    for warm, cold in ((a_warm, a_cold), (b_warm, b_cold)):
        assert warm["tokens"] == cold["tokens"]
        assert warm["logprobs"] == cold["logprobs"]
        assert warm["state"] == cold["state"]
    # negative control: one corrupted section of the stored links is caught
    _, worker = engine_parts(llm)
    for link_id in list(worker.store._entries):
        sec = worker.store.buffers(link_id).sections
        name = next(n for n in sec if "#2" in n or "#3" in n)   # a PLE state part
        sec[name].add_(torch.ones_like(sec[name]))
    bad = run(llm, A)
    assert bad["cached"] == 3 * GRID
    assert bad["logprobs"] != a_cold["logprobs"] or bad["state"] != a_cold["state"]
