"""Flash-Next in vLLM (CPU) against transformers' qwen4_exp, in float32 with a tight tolerance.

One float32 engine serves most tests (module scope); the chunked-prefill, bf16 and the two
negative-control engines are small and short-lived. Prompt lengths cross the QSA block
(4 tokens), the indexer budget (60 tokens: selection starts at the 64th token), the prefill
chunk (2048 tokens per step) and the state of several steps.
"""

from __future__ import annotations

import pytest

from .helpers import (
    MAX_TOL,
    MEAN_TOL,
    HFOracle,
    drop_indexer_selection,
    engine,
    logprob_distance,
    prompt_ids,
)

pytestmark = pytest.mark.slow

LENGTHS = [1, 63, 64, 65, 1000, 5000]


@pytest.fixture(scope="module")
def model_path(embedded_model):
    return embedded_model("flash-next-tiny")


@pytest.fixture(scope="module")
def oracle(model_path):
    return HFOracle(model_path)


@pytest.fixture(scope="module")
def llm(model_path):
    with engine(model_path) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference_logprobs(oracle):
    return {n: oracle.logprobs(prompt_ids(n, seed=n)) for n in LENGTHS}


@pytest.fixture(scope="module")
def vllm_prompt_logprobs(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=prompt_ids(n, seed=n)) for n in LENGTHS]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20, logprobs=20)
    return dict(zip(LENGTHS, llm.generate(prompts, params, use_tqdm=False), strict=True))


@pytest.mark.parametrize("n", LENGTHS)
def test_prompt_logprobs_match_transformers(n, vllm_prompt_logprobs, reference_logprobs):
    mean, worst, count = logprob_distance(vllm_prompt_logprobs[n], reference_logprobs[n])
    assert count >= 20 * n
    assert mean < MEAN_TOL, (n, mean, worst)
    assert worst < MAX_TOL, (n, mean, worst)


def _greedy(llm, prompts: list[list[int]], n: int = 32) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY_PROMPTS = [prompt_ids(n, seed=100 + n) for n in (5, 70, 700)]


def test_greedy_continuations_match_transformers(llm, oracle):
    ours = _greedy(llm, GREEDY_PROMPTS)
    for prompt, got in zip(GREEDY_PROMPTS, ours, strict=True):
        assert got == oracle.greedy(prompt, 32), len(prompt)


def test_batched_requests_get_their_solo_tokens(llm):
    batched = _greedy(llm, [*GREEDY_PROMPTS, prompt_ids(300, seed=7)])
    solo = [_greedy(llm, [p])[0] for p in [*GREEDY_PROMPTS, prompt_ids(300, seed=7)]]
    assert batched == solo


def test_chunked_prefill_matches_unchunked(model_path, vllm_prompt_logprobs, llm):
    """1000 tokens in steps of 100 (crossing blocks and the state at odd offsets) give the
    logprobs and the greedy tokens of the single-step prefill."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    unchunked_greedy = _greedy(llm, [prompt_ids(1000, seed=1000)])
    with engine(model_path, max_num_batched_tokens=100, max_model_len=2048) as small:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20, logprobs=20)
        out = small.generate([TokensPrompt(prompt_token_ids=prompt_ids(1000, seed=1000))],
                             params, use_tqdm=False)[0]
        chunked_greedy = _greedy(small, [prompt_ids(1000, seed=1000)])
    ref = vllm_prompt_logprobs[1000]
    diffs = []
    for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
        diffs += [abs(v.logprob - b[t].logprob) for t, v in a.items() if t in b]
    assert max(diffs) < 1e-4
    assert chunked_greedy == unchunked_greedy


@pytest.mark.parametrize("skip", ["ple", "indexer"])
def test_negative_controls_fail_the_tolerance(skip, model_path, reference_logprobs):
    """Dropping a component must be caught: the tolerance is far below its effect."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_hybridcache.flash_next.model import SKIP_ENV

    # PLE is skipped inside the model (env switch); the indexer's selection is dropped by
    # rewiring the loaded model from here (vLLM ships the function to the worker, hence the
    # insecure-serialization switch, for this engine only)
    env = ({SKIP_ENV: skip} if skip == "ple"
           else {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    with engine(model_path, env=env, max_model_len=2048) as broken:
        if skip == "indexer":
            assert all(n > 0 for n in broken.apply_model(drop_indexer_selection))
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20, logprobs=20)
        out = broken.generate([TokensPrompt(prompt_token_ids=prompt_ids(1000, seed=1000))],
                              params, use_tqdm=False)[0]
    mean, _, _ = logprob_distance(out, reference_logprobs[1000])
    assert mean > 100 * MEAN_TOL, (skip, mean)


def test_bf16_runs_close_to_transformers_bf16(model_path):
    """The bf16 path (the default dtype) loads and stays near the bf16 reference."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = prompt_ids(300, seed=3)
    with engine(model_path, dtype="bfloat16", max_model_len=2048) as llm16:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20, logprobs=20)
        out = llm16.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    ref = HFOracle(model_path, dtype=torch.bfloat16).logprobs(ids)
    mean, _, _ = logprob_distance(out, ref)
    assert mean < 0.05, mean
