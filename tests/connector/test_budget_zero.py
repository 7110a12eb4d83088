"""Budget 0 turns the cache off: outputs equal vLLM's without the plugin, token for token and
logprob for logprob (design rule 5)."""

from __future__ import annotations

import pytest

from tests.connector.conftest import connector_engine

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


def test_budget_zero_is_vllm_without_plugin(embedded_model, monkeypatch):
    """Through the plugin's entry points, budget 0 installs nothing: the engine is stock vLLM."""
    from vllm_hybridcache.serving.flags import apply_plugin
    from vllm_hybridcache.serving.python_api import llm_kwargs

    assert llm_kwargs(budget_bytes=0) == {}
    assert llm_kwargs(enabled=False) == {}
    monkeypatch.setenv("VLLM_HYBRIDCACHE_BUDGET_BYTES", "0")
    args = ["serve", str(embedded_model("qwen3-next-tiny"))]
    assert apply_plugin(["hybridcache"], args) == args


def test_connector_with_budget_zero_changes_nothing_it_controls(embedded_model):
    """The connector configured by hand with budget 0: nothing cached, no cuts, and the prefill
    (first token and its logprobs) equals stock vLLM bit for bit. Decode logprobs may differ in
    the last bits: vLLM's decode path with any KV connector installed is not bit-identical to
    the path without one, so only greedy tokens are compared there."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from vllm_hybridcache.serving.flags import CONNECTOR_CONFIG, SCHEDULER_CLS

    path = embedded_model("qwen3-next-tiny")
    with connector_engine(path, plugin=False, enable_prefix_caching=False,
                          scheduler_cls=SCHEDULER_CLS,
                          kv_transfer_config=KVTransferConfig(
                              **CONNECTOR_CONFIG,
                              kv_connector_extra_config={"budget_bytes": 0, "grid": 256})) as off:
        assert isinstance(off, LLM)
        with_plugin_off = outputs(off)
    with connector_engine(path, plugin=False, enable_prefix_caching=False) as stock:
        plain = outputs(stock)
    assert all(cached == 0 for _, cached, _ in with_plugin_off)
    for (tok_a, _, lp_a), (tok_b, _, lp_b) in zip(with_plugin_off, plain, strict=True):
        assert tok_a == tok_b
        assert lp_a[0] == lp_b[0]
