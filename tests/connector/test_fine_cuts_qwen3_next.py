"""Fine segmentation on vLLM's own Qwen3-Next (CPU backend, bf16) with the CPU attention pin
(opt-in, VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT=1; put in place here for this engine):
vLLM's GDN op hands its states at 64-aligned offsets inside a step
(compat.install_cpu_gdn_inner_states), so links are captured there (docs/split-invariance.md).
With the default grid (2048) each prompt is one prefill step: the identical resend hits the
last 64-aligned position leaving a 64-token resume and the diverging prompt a junction, both
inside the step. Each hit must equal a cold prefill of the same prompt in the same engine,
bit for bit: every state part at the prompt's end, the logprobs and the greedy tokens.
"""

from __future__ import annotations

import pytest

from tests.connector.conftest import connector_engine, cpu_attention_pinned
from tests.connector.test_fine_cuts import check_hits_inside_steps
from vllm_hybridcache.testing.instrumentation import instrument

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(inproc, monkeypatch_module, embedded_model):
    with cpu_attention_pinned(monkeypatch_module), connector_engine(
            embedded_model("qwen3-next-tiny"), dtype="bfloat16") as engine:
        instrument(engine)      # state probes at each prefill's end: the "state" of run()
        yield engine

def test_qwen3_next_fine_hits_inside_steps_equal_cold(llm):
    # near A's end: the last 64-aligned position leaving a 64-token resume (the floor of
    # vLLM's GDN models, segmentation_mode.MIN_INNER_RESUME): 128 for its 200 tokens
    check_hits_inside_steps(llm, near_end=(200 - 64) // 64 * 64)
