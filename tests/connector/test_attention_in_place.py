"""Attention K/V in place on qwen3-next-tiny: warm runs equal cold runs, bit for bit.

The engine runs with the CPU attention pin on (opt-in), so in fine segmentation (links at
the grid cuts and also inside a step: near the prompt's end, and where it parts from a recent
prompt): in place and inner links together; every other engine test runs in place in step
mode (the default). A link inside a step is served only when the step resuming from it holds at
least 64 tokens (vLLM's GEMMs compute a very short step's rows with other bits: a 4-token
resume was seen to leave another conv state than the cold run's).

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

from tests.connector.conftest import connector_engine, cpu_attention_pinned, engine_parts
from vllm_hybridcache.testing.instrumentation import instrument, instrumentation_of

pytestmark = pytest.mark.slow

GRID = 256
A = [100 + (i * 7) % 3000 for i in range(3 * GRID + 132)]          # cuts 256, 512, 768
B = A[: 2 * GRID] + [50 + (i * 13) % 3000 for i in range(300)]     # shares 2 segments


S = A[: 3 * GRID + 72]              # a prefix of A ending 8 tokens after A's link at 832


def near_end(prompt) -> int:
    """Fine mode's link near a prompt's end on vLLM's Qwen3-Next: the last 64-aligned position
    that leaves at least 64 tokens to the resumed step."""
    return (len(prompt) - 64) // 64 * 64


@pytest.fixture(scope="module")
def llm(inproc, monkeypatch_module, embedded_model):
    with cpu_attention_pinned(monkeypatch_module), connector_engine(
            embedded_model("qwen3-next-tiny"),
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
    assert sched.segmentation_mode == "fine"       # the pin (the fixture's)
    block = sched.in_place_block
    assert block > 0                               # the scheduler installed it
    sched.clear()
    a_cold = run(llm, A)
    sched.clear()
    b_cold = run(llm, B)
    assert a_cold["cached"] == b_cold["cached"] == 0 and a_cold["state"]
    sched.clear()
    run(llm, A)                      # links at 256, 512, 768, near_end(A); blocks in the pool
    before = in_place(llm)
    restores = sched.tree.stats()
    b_warm = run(llm, B)                           # link at 512: blocks below it in place
    a_warm = run(llm, A)                           # link at near_end(A), inside A's last step
    after = in_place(llm)
    done = sched.tree.stats()
    assert done.restores_failed == restores.restores_failed      # loaded, not recomputed
    assert done.restores - restores.restores == 2
    assert (b_warm["cached"], a_warm["cached"]) == (2 * GRID, near_end(A))
    assert near_end(A) > 3 * GRID                  # deeper than the last grid cut
    # every whole block up to each link: vLLM's local hit stops a block below, and the block
    # it then allocates for the loaded rows is taken from its cache (A's) after all
    expected = 2 * GRID // block * block + near_end(A) // block * block
    assert expected > 0
    assert after["tokens_in_place"] - before["tokens_in_place"] == expected
    assert after["bytes_saved"] > before["bytes_saved"]
    assert llm.reset_prefix_cache()                # vLLM's blocks gone, our links kept
    b_copy = run(llm, B)                           # B's own link at 768 (captured warm)
    assert b_copy["cached"] == 3 * GRID and near_end(B) < 3 * GRID
    assert in_place(llm)["tokens_in_place"] == after["tokens_in_place"]   # all copied
    # S ends 8 tokens after A's link at near_end(A) (not a cut): too short a resume, so it is
    # served from the cut at 768 below it
    assert 0 < len(S) - near_end(A) < 64
    s_warm = run(llm, S)
    assert s_warm["cached"] == 3 * GRID
    sched.clear()
    s_cold = run(llm, S)
    for name, warm, cold in (("b_warm", b_warm, b_cold), ("a_warm", a_warm, a_cold),
                             ("b_copy", b_copy, b_cold), ("s_warm", s_warm, s_cold)):
        assert warm["tokens"] == cold["tokens"], name
        assert warm["logprobs"] == cold["logprobs"], name
        assert warm["state"] == cold["state"], name


def test_corrupted_links_beside_in_place_blocks_are_caught(llm):
    """Negative control: with the attention blocks below the link in place, the recurrent
    sections and the rows of the last block below the link copied from it are what the
    request reads, so a corrupted link changes its state parts (the recurrent state at the
    prompt's end, 68 tokens after the link at near_end(A)): the comparison above can
    fail."""
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
    assert warm["cached"] == near_end(A) and in_place(llm)["tokens_in_place"] > before
    assert warm["state"] != cold["state"]
