"""Fine segmentation on vLLM's own Qwen3-Next (CPU backend, bf16) with the CPU attention pin
(VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT=1): vLLM's GDN op hands its states at 64-aligned
offsets inside a step (compat.install_cpu_gdn_inner_states), so links are captured there
(docs/split-invariance.md). With the default grid (2048) each prompt is one prefill step: the
identical resend hits the prompt's last 64-aligned position and the diverging prompt a junction,
both inside the step. Each hit must equal a cold prefill of the same prompt in the same engine,
bit for bit: every state part at the prompt's end, the logprobs and the greedy tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_exactness import clear, run
from tests.connector.test_fine_cuts import same
from vllm_hybridcache import compat
from vllm_hybridcache.adapter.domain import request_domain
from vllm_hybridcache.config import CPU_ATTN_SPLIT_INVARIANT_ENV
from vllm_hybridcache.instrumentation import instrument

pytestmark = pytest.mark.slow

A = [100 + (i * 7) % 3000 for i in range(200)]                  # last 64-aligned: 192
C = A[:150] + [9 + (i * 17) % 3000 for i in range(40)]           # parts from A at 150: 128


@pytest.fixture(scope="module")
def llm(inproc, monkeypatch_module, embedded_model):
    """The pin and the GDN bend are put in place here (vLLM loads the plugin once per process,
    possibly earlier without the pin) and taken out again afterwards, so no later engine of
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
    sched, worker = engine_parts(llm)
    assert sched.segmentation_mode == "fine" and sched.segmentation.grid == 2048
    clear(llm)
    a_cold = run(llm, A)
    clear(llm)
    c_cold = run(llm, C)             # parts from A (seen before) at 150: a junction at 128
    assert (a_cold["cached"], c_cold["cached"]) == (0, 0)

    clear(llm)
    run(llm, A)                      # one step; links at 128 (junction) and 192 inside it
    a_warm = run(llm, A)             # an identical resend: 8 tokens prefilled
    assert a_warm["cached"] == 192
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
