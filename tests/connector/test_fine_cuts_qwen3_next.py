"""Fine segmentation on vLLM's own Qwen3-Next (CPU backend, bf16) with the CPU attention pin
(on by default on the CPU platform; VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT=0 turns it off):
vLLM's GDN op hands its states at 64-aligned offsets inside a step
(compat.install_cpu_gdn_inner_states), so links are captured there (docs/split-invariance.md).
With the default grid (2048) each prompt is one prefill step: the identical resend hits the
last 64-aligned position leaving a 64-token resume and the diverging prompt a junction, both
inside the step. Each hit must equal a cold prefill of the same prompt in the same engine,
bit for bit: every state part at the prompt's end, the logprobs and the greedy tokens.
"""

from __future__ import annotations

import pytest

from tests.connector.conftest import connector_engine
from tests.connector.test_fine_cuts import check_hits_inside_steps
from vllm_hybridcache import compat
from vllm_hybridcache.config import CPU_ATTN_SPLIT_INVARIANT_ENV
from vllm_hybridcache.instrumentation import instrument

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(inproc, monkeypatch_module, embedded_model):
    """The pin and the GDN bend are put in place here (vLLM loads the plugin once per process,
    possibly earlier with the pin turned off) and the process's previous state is put back
    afterwards (pinned where the plugin's default already pinned it), so no later engine of
    this process runs with them unasked."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch_module.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "1")
    build, nonspec = cpu_attn.CPUAttentionMetadataBuilder.build, gdn._cpu_gdn_attention_nonspec
    compat.pin_cpu_attention_split()
    compat.install_cpu_gdn_inner_states()
    try:
        with connector_engine(embedded_model("qwen3-next-tiny"), dtype="bfloat16") as engine:
            instrument(engine)      # state probes at each prefill's end: the "state" of run()
            yield engine
    finally:
        cpu_attn.CPUAttentionMetadataBuilder.build = build
        gdn._cpu_gdn_attention_nonspec = nonspec


def test_qwen3_next_fine_hits_inside_steps_equal_cold(llm):
    # near A's end: the last 64-aligned position leaving a 64-token resume (the floor of
    # vLLM's GDN models, scheduler_side.MIN_INNER_RESUME): 128 for its 200 tokens
    check_hits_inside_steps(llm, near_end=(200 - 64) // 64 * 64)
