"""This package's Flash-Next on a quantized checkpoint: flash-next-tiny as compressed-tensors
W8A8 int8 (`models/quantize.py`; flash_next/parallel.py builds its GDN, attention and
shared-expert projections as vLLM's `ReplicatedLinear` with the checkpoint's quantization).

Checked, in one engine each:
- the quantized projections run vLLM's W8A8 int8 scheme, the others (the GDN gates `in_proj_b`
  and `in_proj_a`, the indexer, the routed experts) stay plain float layers;
- prompt logprobs agree with the dequantized twin's (the same int8 weights times their scales,
  in a plain vLLM engine) within `LOGPROB_TOLERANCE` on average; the same comparison one
  position off is more than twice the bound (negative control);
- warm equals cold, bit for bit (greedy tokens, logprobs, the digests of every state section
  and complete K/V block) for a 3-link chain and a branch; a corrupted link fails it.
"""

from __future__ import annotations

import pytest

from tests.connector.conftest import connector_engine
from tests.connector.test_exactness import (
    GRID,
    A,
    check_chain_and_branch,
    clear,
    corrupt_links,
    run,
)
from tests.connector.test_quantized import assert_close_to_reference, prompt_logprobs
from vllm_hybridcache.testing.instrumentation import instrument

pytestmark = pytest.mark.slow

LOGPROB_TOLERANCE = 0.15
"""Mean |quantized - dequantized| prompt logprob, nats. Measured on this model (bf16, prompt
A, a 2-core Xeon with AVX-512 and AMX): 0.052; the same comparison one position off, 0.66."""


@pytest.fixture(scope="module")
def dequantized_logprobs(inproc, embedded_model):
    with connector_engine(embedded_model("flash-next-tiny-w8a8-dequant"), plugin=False,
                          dtype="bfloat16", enable_prefix_caching=False) as ref:
        return prompt_logprobs(ref, A)


@pytest.fixture(scope="module")
def llm(inproc, embedded_model, dequantized_logprobs):
    with connector_engine(embedded_model("flash-next-tiny-w8a8"), dtype="bfloat16",
                          extra={"grid": GRID}) as engine:
        instrument(engine)
        yield engine


def _layers(worker) -> dict[str, str]:
    out = {}
    for name, m in worker.model_runner.model.named_modules():
        if name.endswith(("in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj", "q_proj",
                          "o_proj", "shared_expert.up_proj", "index_qk_proj")):
            scheme = getattr(m, "scheme", None)
            out[name] = type(scheme).__name__ if scheme is not None else type(m).__name__
    return out


def test_the_quantized_projections_run_vllm_w8a8_int8(llm):
    (layers,) = llm.collective_rpc(_layers)
    quantized = {n: s for n, s in layers.items()
                 if n.startswith("model.layers.") and not n.endswith(("in_proj_b",
                                                                       "index_qk_proj"))}
    assert quantized and set(quantized.values()) == {"CompressedTensorsW8A8Int8"}, layers
    assert {s for n, s in layers.items() if n.endswith(("in_proj_b", "index_qk_proj"))} == {
        "Linear"}


def test_prompt_logprobs_agree_with_the_dequantized_weights(llm, dequantized_logprobs):
    assert_close_to_reference(prompt_logprobs(llm, A), dequantized_logprobs, LOGPROB_TOLERANCE)


def test_warm_runs_equal_cold_runs_on_the_quantized_model(llm):
    a_cold = check_chain_and_branch(llm)
    corrupt_links(llm)                       # negative control: a corrupted link is caught
    bad = run(llm, A)
    assert bad["cached"] == 3 * GRID
    assert bad["logprobs"] != a_cold["logprobs"] or bad["state"] != a_cold["state"]
    clear(llm)
