"""Fine segmentation on vLLM's own Qwen3-Next (CPU backend, bf16), its attention made
split-invariant either by our kernel (the default, `auto`; `kernel` here, which refuses to start
where it does not apply) or by the pin of vLLM's own kernel (opt-in,
VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT=1; put in place here for that engine): vLLM's GDN op
hands its states at 64-aligned offsets inside a step
(compat.install_cpu_gdn_inner_states), so links are captured there (docs/split-invariance.md).
With the default grid (2048) each prompt is one prefill step: the identical resend hits the
last 64-aligned position leaving a 64-token resume and the diverging prompt a junction, both
inside the step. Each hit must equal a cold prefill of the same prompt in the same engine,
bit for bit: every state part at the prompt's end, the logprobs and the greedy tokens.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from tests.connector.conftest import connector_engine, cpu_attention_pinned
from tests.connector.test_fine_cuts import check_hits_inside_steps
from vllm_hybridcache.testing.instrumentation import instrument

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["kernel", "pin"])
def llm(request, inproc, monkeypatch_module, embedded_model):
    from vllm_hybridcache import compat
    from vllm_hybridcache.config import CPU_ATTN_SPLIT_INVARIANT_ENV
    from vllm_hybridcache.ops import cpu_attention

    calls: list[int] = []
    kernel = cpu_attention.split_invariant_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch_module.setattr(cpu_attention, "split_invariant_attention", counted)

    if request.param == "kernel":
        monkeypatch_module.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "kernel")
        compat.install_split_invariant_cpu_attention()      # idempotent: plugin load did it
        compat.install_cpu_gdn_inner_states()
        setting = nullcontext()
    else:
        setting = cpu_attention_pinned(monkeypatch_module)
    with setting, connector_engine(embedded_model("qwen3-next-tiny"),
                                   dtype="bfloat16") as engine:
        instrument(engine)      # state probes at each prefill's end: the "state" of run()
        engine.hybridcache_test = (request.param, calls)
        yield engine
    monkeypatch_module.delenv(CPU_ATTN_SPLIT_INVARIANT_ENV, raising=False)

def test_qwen3_next_fine_hits_inside_steps_equal_cold(llm):
    # near A's end: the last 64-aligned position leaving a 64-token resume (the floor of
    # vLLM's GDN models, segmentation_mode.MIN_INNER_RESUME): 128 for its 200 tokens
    check_hits_inside_steps(llm, near_end=(200 - 64) // 64 * 64)
    how, calls = llm.hybridcache_test
    # the kernel computed the attention in its engine, vLLM's pinned op in the other
    assert (len(calls) > 0) == (how == "kernel"), (how, len(calls))
