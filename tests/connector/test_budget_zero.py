"""Budget 0 turns the cache off: outputs equal vLLM's without the plugin, token for token and
logprob for logprob (design rule 5)."""

from __future__ import annotations

import gc

import pytest

from tests.connector.conftest import make_llm

pytestmark = pytest.mark.slow

PROMPTS = [[100 + (i * 7) % 3000 for i in range(700)],
           [100 + (i * 7) % 3000 for i in range(512)] + [9, 8, 7] * 40]


def outputs(llm):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=5, detokenize=False)
    res = []
    for p in PROMPTS * 2:  # the second pass would hit if anything were cached
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        res.append((list(o.outputs[0].token_ids), o.num_cached_tokens,
                    [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs]))
    return res


def test_budget_zero_equals_vllm_without_plugin(embedded_model):
    path = embedded_model("qwen3-next-tiny")
    off = make_llm(path, extra={"budget_bytes": 0, "grid": 256})
    with_plugin_off = outputs(off)
    del off
    gc.collect()
    stock = make_llm(path, plugin=False, enable_prefix_caching=False)
    plain = outputs(stock)
    del stock
    gc.collect()
    assert all(cached == 0 for _, cached, _ in with_plugin_off)
    assert with_plugin_off == plain
