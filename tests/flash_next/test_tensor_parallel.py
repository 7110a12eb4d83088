"""Flash-Next at tensor parallel size 2 against transformers, in float32 (issue 30, item 1).

Each of the two ranks holds half of every layer's heads and experts (flash_next/parallel.py):
vLLM's Column/RowParallel and MergedColumnParallel projections, `VocabParallelEmbedding`,
`ParallelLMHead` with vLLM's `LogitsProcessor`; the GDN states and the QSA rows of a rank are
its own heads' only. vLLM's CPU backend runs the two ranks with its multiprocessing executor
(one worker process per rank, one core each).

The routed experts are vLLM's fused MoE there (flash_next/moe.py), split by intermediate size
(vLLM's expert parallelism is refused on the CPU platform: test_config_hook.py).

Checked: the prompt logprobs and greedy tokens of the TP = 2 engine agree with transformers'
float32 model within the TP = 1 tolerance (test_correctness.py), across the indexer budget and
several prefill steps; each rank holds its half (the shapes, and different values on the two
ranks). Negative control: rank 1's part of every routed expert layer zeroed (a lost shard)
exceeds the tolerance.
"""

from __future__ import annotations

import os

import pytest

from .helpers import MAX_TOL, MEAN_TOL, HFOracle, engine, logprob_distance, prompt_ids

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="TP = 2 on CPU binds one core per rank")]

LENGTHS = [1, 65, 3000]


@pytest.fixture(scope="module")
def model_path(embedded_model):
    return embedded_model("flash-next-tiny")


@pytest.fixture(scope="module")
def oracle(model_path):
    return HFOracle(model_path)


@pytest.fixture(scope="module")
def llm(model_path):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    # the engine core in this process, so the rank probes below reach the workers directly
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{first}|{second}",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with engine(model_path, tensor_parallel_size=2, env=env) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(oracle):
    return {n: oracle.logprobs(prompt_ids(n, seed=n)) for n in LENGTHS}


def _prompt_logprobs(llm) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=prompt_ids(n, seed=n)) for n in LENGTHS]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20, logprobs=20)
    return dict(zip(LENGTHS, llm.generate(prompts, params, use_tqdm=False), strict=True))


def _shards(worker) -> dict:
    """What this rank holds of layer 0 (GDN) and layer 3 (attention)."""
    model = worker.model_runner.model
    gdn = model.model.layers[0].linear_attn
    attn = model.model.layers[3].self_attn
    return {"qkv_rows": tuple(gdn.in_proj_qkv.weight.shape),
            "state": [tuple(s) for s in gdn.get_state_shape()[:2]],
            "v_heads": gdn.num_v_heads, "q_heads": attn.num_heads,
            "kv_heads": attn.num_kv_heads, "row": attn.width,
            "w13": tuple(routed_weights(model.model.layers[0].mlp)[0].shape),
            "A_log": gdn.A_log.detach().tolist()}


def routed_weights(mlp) -> tuple:
    """(w13, w2) of a layer's routed experts: at TP > 1 vLLM's fused MoE (flash_next/moe.py),
    whose parameters keep their [E, 2I, H] / [E, H, I] shapes (the CPU kernel repacks the
    values in place)."""
    experts = mlp.experts.routed_experts
    return experts.w13_weight, experts.w2_weight


def _zero_expert_half(worker, rank: int, restore: bool = False) -> int:
    """Zero (or put back) rank `rank`'s half of every routed expert (`w2`: zeros in any
    packing); layers touched."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != rank:
        return 0
    model = worker.model_runner.model
    saved = worker.__dict__.setdefault("_saved_w2", {})
    for i, layer in enumerate(model.model.layers):
        w = routed_weights(layer.mlp)[1]
        if restore:
            w.data.copy_(saved[i])
        else:
            saved[i] = w.detach().clone()
            w.data.zero_()
    return len(model.model.layers)


def test_each_rank_holds_its_half(llm, oracle):
    config = oracle.model.config.get_text_config()
    ranks = llm.collective_rpc(_shards)
    assert len(ranks) == 2
    for r in ranks:
        assert r["v_heads"] == config.linear_num_value_heads // 2
        assert r["q_heads"] == config.num_attention_heads // 2
        assert r["state"][1][0] == config.linear_num_value_heads // 2
        assert r["w13"][:2] == (config.num_experts, config.moe_intermediate_size)  # 2 * I / 2
        # one kv head, replicated: fewer kv heads than ranks
        assert r["kv_heads"] == max(1, config.num_key_value_heads // 2)
    assert ranks[0]["qkv_rows"] == ranks[1]["qkv_rows"]
    assert ranks[0]["A_log"] != ranks[1]["A_log"]  # different heads


def test_prompt_logprobs_match_transformers_at_tp2(llm, reference):
    for n, out in _prompt_logprobs(llm).items():
        mean, worst, count = logprob_distance(out, reference[n])
        assert count >= 20 * n
        assert mean < MEAN_TOL, (n, mean, worst)
        assert worst < MAX_TOL, (n, mean, worst)


def test_greedy_continuations_match_transformers_at_tp2(llm, oracle):
    from vllm import SamplingParams

    ids = prompt_ids(200, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == oracle.greedy(ids, 24)


def test_negative_control_a_lost_shard_fails_the_tolerance(llm, reference):
    assert sum(llm.collective_rpc(_zero_expert_half, args=(1,))) >= 1
    try:
        outs = _prompt_logprobs(llm)
    finally:
        llm.collective_rpc(_zero_expert_half, args=(1, True))
    worst = max(logprob_distance(outs[n], reference[n])[0] for n in LENGTHS if n > 1)
    assert worst > 10 * MEAN_TOL
