"""Attention K/V in place on qwen3-next-tiny: warm runs equal cold runs, bit for bit.

With `attention_in_place` a hit's attention blocks below the restoring link come from vLLM's
block pool (shared with the request that wrote them) and the recurrent sections plus the last
block's rows come from the link. In one engine: cold runs of A and B (no link, so no local hit
either); A again to capture links; B and A warm from in-place blocks; B warm from the host copy
after vLLM's prefix cache was reset (its blocks gone, the links kept). Every warm run gives the
greedy tokens, logprobs (float equality) and final state parts (sections and complete KV
blocks) of the cold run. Negative control: corrupted links change the result.
"""

from __future__ import annotations

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from vllm_hybridcache.instrumentation import instrument, instrumentation_of

pytestmark = pytest.mark.slow

GRID = 256
A = [100 + (i * 7) % 3000 for i in range(3 * GRID + 132)]          # cuts 256, 512, 768
B = A[: 2 * GRID] + [50 + (i * 13) % 3000 for i in range(300)]     # shares 2 segments


@pytest.fixture(scope="module")
def llm(inproc, embedded_model):
    with connector_engine(embedded_model("qwen3-next-tiny"),
                          extra={"grid": GRID, "message_end_min": 64,
                                 "attention_in_place": True,
                                 # no end anchors: a finished request then holds no blocks,
                                 # so vLLM's prefix cache can be reset between runs
                                 "session_anchors": 0}) as engine:
        instrument(engine)
        yield engine


def run(llm, prompt):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=5, detokenize=False)
    out = llm.generate([{"prompt_token_ids": list(prompt)}], sp, use_tqdm=False)[0]
    return {
        "tokens": list(out.outputs[0].token_ids),
        "cached": out.num_cached_tokens,
        "logprobs": [{k: v.logprob for k, v in d.items()} for d in out.outputs[0].logprobs],
        "state": instrumentation_of(llm).take_digests(out.request_id),
    }


def in_place(llm) -> dict[str, int]:
    sched, _ = engine_parts(llm)
    return sched.in_place_stats()


def test_warm_from_in_place_blocks_and_from_the_host_copy_equal_cold(llm):
    sched, _ = engine_parts(llm)
    block = sched.in_place_block
    assert block > 0                               # the scheduler installed it
    sched.clear()
    a_cold = run(llm, A)
    sched.clear()
    b_cold = run(llm, B)
    assert a_cold["cached"] == b_cold["cached"] == 0 and a_cold["state"]
    sched.clear()
    run(llm, A)                                    # links at 256, 512, 768; blocks in the pool
    before = in_place(llm)
    restores = sched.tree.stats()
    b_warm = run(llm, B)                           # link at 512: blocks below it in place
    a_warm = run(llm, A)                           # link at 768
    after = in_place(llm)
    done = sched.tree.stats()
    assert done.restores_failed == restores.restores_failed      # loaded, not recomputed
    assert done.restores - restores.restores == 2
    assert (b_warm["cached"], a_warm["cached"]) == (2 * GRID, 3 * GRID)
    expected = (2 * GRID - 1) // block * block + (3 * GRID - 1) // block * block
    assert expected > 0
    assert after["tokens_in_place"] - before["tokens_in_place"] == expected
    assert after["bytes_saved"] > before["bytes_saved"]
    assert llm.reset_prefix_cache()                # vLLM's blocks gone, our links kept
    b_copy = run(llm, B)                           # B's own link at 768 (captured warm)
    assert b_copy["cached"] == 3 * GRID
    assert in_place(llm)["tokens_in_place"] == after["tokens_in_place"]   # all copied
    for warm, cold in ((b_warm, b_cold), (a_warm, a_cold), (b_copy, b_cold)):
        assert warm["tokens"] == cold["tokens"]
        assert warm["logprobs"] == cold["logprobs"]
        assert warm["state"] == cold["state"]


def test_corrupted_links_beside_in_place_blocks_are_caught(llm):
    """Negative control: with the attention blocks below the link in place, the rows copied
    from the link (the block from 384 to 768 here) are what the request reads, so corrupted
    link rows change its state parts: the comparison above can fail. (A corrupted recurrent
    state alone fades out of this random tiny model's state within the 132-token tail, and
    the tail's own KV block is not complete, so the state digests cannot show it.)"""
    sched, worker = engine_parts(llm)
    sched.clear()
    cold = run(llm, A)                             # captures A's links; blocks in the pool
    for link_id in list(worker.store._entries):
        bufs = worker.store.buffers(link_id)
        for t in (*bufs.sections.values(), *bufs.views.values()):
            t.copy_(torch.full_like(t, 7))
    before = in_place(llm)["tokens_in_place"]
    restores = sched.tree.stats()
    warm = run(llm, A)
    done = sched.tree.stats()
    assert (done.restores - restores.restores, done.restores_failed) == (
        1, restores.restores_failed)
    assert warm["cached"] == 3 * GRID and in_place(llm)["tokens_in_place"] > before
    assert warm["state"] != cold["state"]
