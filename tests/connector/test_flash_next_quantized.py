"""This package's Flash-Next on quantized checkpoints: flash-next-tiny as compressed-tensors
W8A8 int8 and as FP8 dynamic, the RDNA4 format (`models/quantize.py`; flash_next/parallel.py
builds its GDN, attention and shared-expert projections as vLLM's `ReplicatedLinear` with the
checkpoint's quantization, and its routed experts as vLLM's fused MoE: flash_next/moe.py).

Checked, in one engine per format:
- the quantized projections run vLLM's scheme of the format (`CompressedTensorsW8A8Int8`,
  `CompressedTensorsW8A8Fp8`), the others (the GDN gates `in_proj_b` and `in_proj_a`, the
  indexer) stay plain float layers, and the routed experts are vLLM's fused MoE with its
  unquantized method (the checkpoint ignores them);
- prompt logprobs agree with the dequantized twin's (the same 8-bit weights times their
  scales, in a plain vLLM engine) within the format's tolerance on average; the same
  comparison one position off is more than twice the bound (negative control);
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

FORMATS = {"w8a8": ("CompressedTensorsW8A8Int8", 0.15), "fp8": ("CompressedTensorsW8A8Fp8", 0.25)}
"""Format -> (vLLM's scheme, tolerance: mean |quantized - dequantized| prompt logprob, nats).
Measured on this model (bf16, prompt A): W8A8 0.052 on a 2-core Xeon with AVX-512 and AMX and
on a 2-core AMD EPYC with AVX-512 (0.66 one position off); FP8 0.105 on the EPYC (0.67 one
position off). FP8 activations keep 3 mantissa bits to int8's 7, hence the wider bound."""


@pytest.fixture(scope="module", params=list(FORMATS))
def fmt(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def dequantized_logprobs(inproc, embedded_model, fmt):
    with connector_engine(embedded_model(f"flash-next-tiny-{fmt}-dequant"), plugin=False,
                          dtype="bfloat16", enable_prefix_caching=False) as ref:
        return prompt_logprobs(ref, A)


@pytest.fixture(scope="module")
def llm(inproc, embedded_model, fmt, dequantized_logprobs):
    with connector_engine(embedded_model(f"flash-next-tiny-{fmt}"), dtype="bfloat16",
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


def test_the_quantized_projections_run_the_format_scheme(llm, fmt):
    (layers,) = llm.collective_rpc(_layers)
    quantized = {n: s for n, s in layers.items()
                 if n.startswith("model.layers.") and not n.endswith(("in_proj_b",
                                                                       "index_qk_proj"))}
    assert quantized and set(quantized.values()) == {FORMATS[fmt][0]}, layers
    assert {s for n, s in layers.items() if n.endswith(("in_proj_b", "index_qk_proj"))} == {
        "Linear"}


def _routed_experts(worker) -> set[str]:
    """The quantization method of every layer's routed experts."""
    return {type(layer.mlp.experts.routed_experts.quant_method).__name__
            for layer in worker.model_runner.model.model.layers}


def test_the_routed_experts_are_vllm_fused_moe_in_the_float_dtype(llm):
    """With a quantization config the routed experts are vLLM's fused MoE (flash_next/moe.py);
    the checkpoint ignores them (`mlp.experts`), so vLLM picks its unquantized method."""
    (methods,) = llm.collective_rpc(_routed_experts)
    assert methods == {"UnquantizedFusedMoEMethod"}


def test_prompt_logprobs_agree_with_the_dequantized_weights(llm, fmt, dequantized_logprobs):
    assert_close_to_reference(prompt_logprobs(llm, A), dequantized_logprobs, FORMATS[fmt][1])


def test_warm_runs_equal_cold_runs_on_the_quantized_model(llm):
    a_cold = check_chain_and_branch(llm)
    corrupt_links(llm)                       # negative control: a corrupted link is caught
    bad = run(llm, A)
    assert bad["cached"] == 3 * GRID
    assert bad["logprobs"] != a_cold["logprobs"] or bad["state"] != a_cold["state"]
    clear(llm)
