"""Fine segmentation: links captured inside a step at 64-aligned positions, where the forward
is split-invariant (Flash-Next's split-invariant forward: the default for a bf16 engine on the
CPU backend of a host without a bf16 GEMM of its own, `split_invariant.plan`; forced on
elsewhere, VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT=1; docs/split-invariance.md). With the
default settings (grid 2048) every prompt here is one
prefill step, so each link below is taken from inside a step, from the states the model hands
to the worker's hook: the prompt's last 64-aligned position (an identical resend prefills at
most 64 tokens) and a junction (the last 64-aligned position before a prompt parts from an
earlier one). Each hit must equal a cold prefill of the same prompt in the same engine, bit
for bit: every state part at the prompt's end, the logprobs and the greedy tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_exactness import clear, run
from vllm_hybridcache.adapter.domain import request_domain
from vllm_hybridcache.testing.instrumentation import instrument

pytestmark = pytest.mark.slow

A = [100 + (i * 7) % 3000 for i in range(200)]                  # last 64-aligned: 192
# parts from A at 150: a junction at 128, C's own link near its end too (192 tokens: the
# resume from 128 holds 64, the floor on vLLM's Qwen3-Next)
C = A[:150] + [9 + (i * 17) % 3000 for i in range(42)]


def _defaults_apply() -> bool:
    """Whether this host is one where `auto` turns the forward on (then the engine below runs
    the defaults, nothing set); elsewhere the forward is forced on for the same checks."""
    from vllm_hybridcache.flash_next.ops import split_invariant

    return split_invariant.host_qualifies()[0]


@pytest.fixture(scope="module")
def llm(inproc, monkeypatch_module, embedded_model):
    from vllm_hybridcache.config import FLASH_NEXT_SPLIT_INVARIANT_ENV

    if _defaults_apply():
        monkeypatch_module.delenv(FLASH_NEXT_SPLIT_INVARIANT_ENV, raising=False)
    else:
        monkeypatch_module.setenv(FLASH_NEXT_SPLIT_INVARIANT_ENV, "1")
    # the checkpoint's dtype (bfloat16), as `vllm serve` loads it
    with connector_engine(embedded_model("flash-next-tiny")) as engine:
        instrument(engine)          # state probes at each prefill's end: the "state" of run()
        yield engine


def test_the_default_puts_a_bf16_engine_in_fine_mode_where_the_host_qualifies(llm):
    sched, _ = engine_parts(llm)
    assert sched.segmentation_mode == "fine"
    if _defaults_apply():
        assert "split-invariant forward on: auto:" in sched._mode_why


def same(warm, cold) -> None:
    assert warm["tokens"] == cold["tokens"]
    assert warm["logprobs"] == cold["logprobs"]
    assert warm["state"] and warm["state"] == cold["state"]


def test_fine_mode_hits_inside_steps_equal_cold(llm):
    check_hits_inside_steps(llm)


def check_hits_inside_steps(llm, near_end: int = 192) -> None:
    """On an engine in fine mode (grid 2048): an identical resend hits A's link near its end
    (`near_end`: its last 64-aligned position, 192, here; on vLLM's Qwen3-Next the last one
    leaving a 64-token resume, 128) and C a junction, both inside A's one step, each equal to
    its cold prefill; a corrupted junction link is caught (the negative control). Shared with
    the Qwen3-Next engine of test_fine_cuts_qwen3_next.py."""
    sched, worker = engine_parts(llm)
    assert sched.segmentation_mode == "fine" and sched.segmentation.grid == 2048
    clear(llm)
    a_cold = run(llm, A)
    clear(llm)
    c_cold = run(llm, C)             # parts from A (seen before) at 150: a junction at 128
    assert (a_cold["cached"], c_cold["cached"]) == (0, 0)

    clear(llm)
    run(llm, A)                      # one step; links at 128 (junction) and near_end in it
    a_warm = run(llm, A)             # an identical resend: len(A) - near_end tokens prefilled
    assert a_warm["cached"] == near_end
    same(a_warm, a_cold)
    c_warm = run(llm, C)
    assert c_warm["cached"] == 128
    same(c_warm, c_cold)

    # negative control: the junction link's state sections, corrupted, are caught
    tree = sched.tree
    domain = request_domain(sched.base_domain, SimpleNamespace(cache_salt=None,
                                                                lora_request=None))
    res = tree.lookup(tree.keys(C), domain, len(C) - 1)
    assert res.tokens == 128
    for t in worker.store.buffers(res.plan.chain[-1].link_id).sections.values():
        if t.is_floating_point():
            t.add_(torch.ones_like(t))
    bad = run(llm, C)
    assert bad["cached"] == 128
    assert bad["logprobs"] != c_cold["logprobs"] or bad["state"] != c_cold["state"]
