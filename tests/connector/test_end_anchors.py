"""End anchors (live continuation) through the greedy gate, in float32 (flash-next-tiny).

An end anchor holds the state where a finished request stopped; it descends from decode steps,
so it is session-exact, not cold-exact: a cold prefill of the same tokens reaches that position
through other kernels (chunked vs recurrent GDN, batched vs single-row attention) and rounds
differently. The gate therefore cannot be a bit-level comparison; it compares the resumed turn
with a cold run of its prompt within the measured decode-vs-prefill drift.

Float32, because in bf16 that drift is not a property of the cache but of the CPU's kernels:
qwen3-next-tiny in bf16 (vLLM's CPU GDN has no float32 path) measured a first-token drift of
up to 0.033 nats with AVX-512/AMX kernels and up to 0.16 nats with AVX2 kernels, over 25 turns,
and the AVX2 run flipped the first token where the cold run's margin was 0.156 nats. In float32
the same scenario drifts by at most 2.4e-6 nats on either ISA, so a tolerance of 1e-3 nats holds
on any x86-64 CPU with a wide margin, while a corrupted anchor still moves logprobs by far more.
(qwen3-next's anchors are checked for hits in bf16 in test_exactness.py.)
"""

from __future__ import annotations

import pytest

from tests.conftest import emulated_cpu_isa
from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_exactness import GRID, anchored_session, clear, run
from vllm_hybridcache.testing.instrumentation import instrument

pytestmark = pytest.mark.slow

# Largest |logprob(resumed) - logprob(cold)| the gate accepts at a position both runs reached
# with the same tokens. Measured on flash-next-tiny in float32, this module's five-turn
# scenario over 5 prompt seeds (25 resumed turns, 6 positions, vLLM's top-5 logprobs): max
# 1.9e-6 nats with AVX-512/AMX kernels, 2.4e-6 with AVX2 kernels (HYBRIDCACHE_TEST_CPU_ISA).
# 1e-3 leaves a factor > 400 for other CPUs and thread counts; a corrupted anchor moves the
# first token's logprobs by whole nats.
DRIFT_NATS = 1e-3


@pytest.fixture(scope="module")
def llm(inproc, embedded_model):
    with connector_engine(embedded_model("flash-next-tiny"), dtype="float32",
                          extra={"grid": GRID, "message_end_min": 64}) as engine:
        instrument(engine)          # state probes: the "state" of run()
        yield engine


def greedy_gate(warm: dict, cold: dict, drift: float = DRIFT_NATS) -> int:
    """Positions where a session-resumed run agrees with the cold run of its prompt.

    While the tokens so far are the same, every logprob both runs report must agree within
    `drift`. Where the picks differ, logits within `drift` of each other can only swap two
    tokens whose cold margin is at most 2 * `drift`: a different pick is accepted only there
    (a tie of the cold run), and the comparison stops (the continuations differ from then on).
    Anything else fails. Returns the number of positions compared before stopping.
    """
    for i, (w, c) in enumerate(zip(warm["tokens"], cold["tokens"], strict=True)):
        top_w, top_c = warm["logprobs"][i], cold["logprobs"][i]
        shared = top_w.keys() & top_c.keys()
        assert c in shared, f"position {i}: the cold pick {c} left the resumed run's top-5"
        worst = max(abs(top_w[k] - top_c[k]) for k in shared)
        assert worst <= drift, f"position {i}: logprobs moved by {worst:.3g} nats"
        if w != c:
            margin = top_c[c] - top_c[w]
            assert margin <= 2 * drift, (
                f"position {i}: resumed run picked {w}, cold run {c} by {margin:.3g} nats")
            return i
    return len(cold["tokens"])


def test_live_continuation_passes_the_greedy_gate(llm):
    """Five turns, each the previous prompt + its answer + a new message: every turn resumes at
    the previous turn's end anchor and agrees with a cold run of its prompt."""
    turns = anchored_session(llm)
    agreed = []
    for p, out in turns[1:]:
        clear(llm)
        agreed.append(greedy_gate(out, run(llm, p)))
    # a cold tie (margin <= 2e-3 nats; the smallest cold margin measured was 2.8e-4) may end a
    # turn's comparison early, but not most of them
    assert sum(agreed) >= len(agreed) * len(turns[0][1]["tokens"]) // 2, agreed


def test_greedy_gate_catches_a_corrupted_anchor(llm):
    """Negative control: the same gate fails on a resumed run whose anchor was corrupted."""
    gate_catches_a_corrupted_anchor(llm)


def gate_catches_a_corrupted_anchor(llm) -> None:
    """An intact end anchor passes the greedy gate against a cold run; the same anchor with its
    states and rows corrupted fails it (shared with the MTP route's tests)."""
    clear(llm)
    p = [200 + (i * 41) % 2500 for i in range(300)]
    first = run(llm, p)
    nxt = p + first["tokens"] + [11 + (i * 3) % 500 for i in range(30)]
    clear(llm)
    cold = run(llm, nxt)
    clear(llm)
    run(llm, p)
    _, worker = engine_parts(llm)
    run(llm, [1, 2, 3])  # one more step: the anchor's copy lands and is committed
    clean = run(llm, nxt)
    assert clean["cached"] == len(p) + len(first["tokens"]) - 1
    assert greedy_gate(clean, cold) == len(cold["tokens"])     # the intact anchor passes
    clear(llm)
    run(llm, p)
    run(llm, [1, 2, 3])
    for link_id in list(worker.store._entries):
        bufs = worker.store.buffers(link_id)
        for t in (*bufs.sections.values(), *bufs.views.values()):
            if t.is_floating_point():   # states and K/V rows; the PLE n-gram context holds ids
                t.mul_(-1.0).add_(0.5)
    warm = run(llm, nxt)
    assert warm["cached"] == len(p) + len(first["tokens"]) - 1
    # measured: the first position moves by < 1e-3 nats (the random tiny model's recurrent
    # layers barely reach the logits through 30 new tokens), the second by 0.037 nats, ~1.5e4
    # times the float32 drift
    with pytest.raises(AssertionError, match=r"position \d: logprobs moved"):
        greedy_gate(warm, cold)


@pytest.mark.skipif(emulated_cpu_isa() != "avx2", reason="HYBRIDCACHE_TEST_CPU_ISA=avx2 only")
def test_emulated_avx2_kernels_are_in_use(llm):
    """The test-only ISA switch took effect: torch dispatches AVX2 kernels, vLLM loaded its
    AVX2 kernel library and would give CPU attention its vector (not AMX) path."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    with open("/proc/self/maps", encoding="utf-8") as maps:
        libs = maps.read()
    assert "_C_AVX2" in libs and "/vllm/_C.abi3.so" not in libs
    assert _get_attn_isa(torch.bfloat16, 32) == "vec"
