"""GDN chunked prefill and recurrent step against HF's torch gated-delta-rule functions.

Tolerance against HF (fp32 everywhere): the kernel computes HF's algorithm, but the UT system
is inverted by forward substitution and applied with matmuls, where HF calls
``solve_triangular``; sums are associated differently, so results agree to fp32 rounding
amplified by the chunk's triangular solve (``atol=1e-5, rtol=1e-4`` on outputs and states of
O(1) magnitude). The recurrent kernel reduces in a different order than ``torch.sum``:
``atol=1e-5, rtol=1e-5``. Kernel-vs-kernel properties (64-aligned split, per-token states) are
exact and compared with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import RAGGED, cu_seqlens
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from vllm_hybridcache.flash_next.ops.triton.gdn import (
    gdn_chunked_prefill_varlen,
    gdn_recurrent_varlen,
)

HK, HV, K, V = 1, 2, 32, 48  # GQA 1:2; V=48 spans two value blocks, the second one masked.
TOL = {"atol": 1e-5, "rtol": 1e-4}


def _inputs(T: int, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HK, K, generator=gen).to(dtype)
    k = torch.randn(T, HK, K, generator=gen).to(dtype)
    v = torch.randn(T, HV, V, generator=gen).to(dtype)
    # Flash-Next's g = -exp(A_log) * softplus(a + dt_bias): negative, O(0.1..1) per token.
    g = -F.softplus(torch.randn(T, HV, generator=gen)) * 0.3
    beta = torch.sigmoid(torch.randn(T, HV, generator=gen))
    return q, k, v, g, beta


def _hf(fn, q, k, v, g, beta, init):
    """One sequence through HF's function (batch 1, heads repeated as the HF layer does)."""
    rep = HV // HK
    out, st = fn(q[None].repeat_interleave(rep, 2), k[None].repeat_interleave(rep, 2), v[None],
                 g=g[None], beta=beta[None], initial_state=None if init is None else init[None],
                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], st[0]


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_ragged_batch_matches_hf(kernel: str) -> None:
    lengths = RAGGED if kernel == "chunk" else [1, 3, 65]
    T = sum(lengths)
    q, k, v, g, beta = _inputs(T, seed=0)
    N = len(lengths)
    state = torch.randn(N + 2, HV, K, V) * 0.1
    slots = torch.tensor([3, 0, 4, 1, 2][:N], dtype=torch.int32)
    has_init = torch.tensor([True, False, True, True, False][:N])
    before = state.clone()
    cu = cu_seqlens(lengths)
    fn = gdn_chunked_prefill_varlen if kernel == "chunk" else gdn_recurrent_varlen
    ref_fn = torch_chunk_gated_delta_rule if kernel == "chunk" else torch_recurrent_gated_delta_rule
    # The chunk kernel steps 64 tokens here (the NVIDIA launch entry); the other tests use the
    # interpreter entry's 32-token sub-chunks (RDNA's).
    extra = {"sub_chunk": 64} if kernel == "chunk" else {}
    out = fn(q, k, v, g, beta, state, cu, slots, has_init, **extra)
    tol = TOL if kernel == "chunk" else {"atol": 1e-5, "rtol": 1e-5}
    for i in range(N):
        a, b = int(cu[i]), int(cu[i + 1])
        init = before[slots[i]] if has_init[i] else None
        ref_o, ref_s = _hf(ref_fn, q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], init)
        torch.testing.assert_close(out[a:b], ref_o, **tol)
        torch.testing.assert_close(state[slots[i]], ref_s, **tol)
    untouched = [s for s in range(N + 2) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


def test_chunk_two_calls_equal_one_call() -> None:
    """A prefill split at a multiple of 64 reproduces the single call bit for bit (with the
    32-token sub-chunks of the interpreter's launch entry)."""
    lengths, splits = [65, 130, 128], [64, 128, 64]
    T = sum(lengths)
    q, k, v, g, beta = _inputs(T, seed=1)
    N = len(lengths)
    slots = torch.arange(N, dtype=torch.int32)
    st_one = torch.zeros(N, HV, K, V)
    cu = cu_seqlens(lengths)
    out_one = gdn_chunked_prefill_varlen(q, k, v, g, beta, st_one, cu, slots,
                                         torch.zeros(N, dtype=torch.bool))

    def part(x: torch.Tensor, lo: list[int], hi: list[int]) -> torch.Tensor:
        return torch.cat([x[cu[i] + lo[i]:cu[i] + hi[i]] for i in range(N)])

    zero, rest_end = [0] * N, lengths
    st_two = torch.full((N, HV, K, V), float("nan"))  # stale slot content must be ignored
    first = [part(x, zero, splits) for x in (q, k, v, g, beta)]
    second = [part(x, splits, rest_end) for x in (q, k, v, g, beta)]
    rest = [n - s for n, s in zip(lengths, splits, strict=True)]
    o1 = gdn_chunked_prefill_varlen(*first, st_two, cu_seqlens(splits), slots,
                                    torch.zeros(N, dtype=torch.bool))
    o2 = gdn_chunked_prefill_varlen(*second, st_two, cu_seqlens(rest), slots,
                                    torch.ones(N, dtype=torch.bool))
    cu1, cu2 = cu_seqlens(splits), cu_seqlens(rest)
    for i in range(N):
        joined = torch.cat([o1[cu1[i]:cu1[i + 1]], o2[cu2[i]:cu2[i + 1]]])
        assert torch.equal(joined, out_one[cu[i]:cu[i + 1]])
    assert torch.equal(st_two, st_one)


def test_prefill_then_decode_and_mtp_per_token_states() -> None:
    """Prefill 64, then 1-token decode, then a 3-token MTP verify with per-token state slots.

    Compared with HF's recurrent rule over the whole sequence (tolerance as above); the
    per-token slots must equal single-token steps exactly (same arithmetic, same order).
    """
    T = 68
    q, k, v, g, beta = _inputs(T, seed=2)
    state = torch.zeros(6, HV, K, V)
    one = torch.tensor([0], dtype=torch.int32)
    o_pre = gdn_chunked_prefill_varlen(q[:64], k[:64], v[:64], g[:64], beta[:64], state,
                                       cu_seqlens([64]), one, torch.tensor([False]))
    o_dec = gdn_recurrent_varlen(q[64:65], k[64:65], v[64:65], g[64:65], beta[64:65], state,
                                 cu_seqlens([1]), one)
    snap = state[0].clone()
    per_tok = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    o_mtp = gdn_recurrent_varlen(q[65:], k[65:], v[65:], g[65:], beta[65:], state,
                                 cu_seqlens([3]), one, out_state_slots=per_tok)
    assert torch.equal(state[0], snap)  # per-token mode leaves the input slot alone

    ref_o, ref_s = _hf(torch_recurrent_gated_delta_rule, q, k, v, g, beta, None)
    torch.testing.assert_close(torch.cat([o_pre, o_dec, o_mtp]), ref_o, **TOL)
    torch.testing.assert_close(state[3], ref_s, **TOL)

    # The state after each draft token equals stepping one token at a time.
    step = torch.zeros(1, HV, K, V)
    step[0] = snap
    zero = torch.tensor([0], dtype=torch.int32)
    for t in range(3):
        sl = slice(65 + t, 66 + t)
        gdn_recurrent_varlen(q[sl], k[sl], v[sl], g[sl], beta[sl], step, cu_seqlens([1]), zero)
        assert torch.equal(step[0], state[1 + t])


def test_chunk_bf16_inputs_fp32_state() -> None:
    """bf16 q/k/v (what the model feeds) with the fp32 state: compared with HF on the same
    bf16 inputs; the output is rounded to bf16 once, so the tolerance is one bf16 ulp."""
    T = 70
    q, k, v, g, beta = _inputs(T, seed=3, dtype=torch.bfloat16)
    state = torch.zeros(1, HV, K, V)
    out = gdn_chunked_prefill_varlen(q, k, v, g, beta, state, cu_seqlens([T]),
                                     torch.tensor([0], dtype=torch.int32))
    ref_o, ref_s = _hf(torch_chunk_gated_delta_rule, q, k, v, g, beta, None)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_o.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(state[0], ref_s, **TOL)


def test_sub_chunk_must_divide_chunk() -> None:
    q, k, v, g, beta = _inputs(4, seed=4)
    with pytest.raises(ValueError):
        gdn_chunked_prefill_varlen(q, k, v, g, beta, torch.zeros(1, HV, K, V), cu_seqlens([4]),
                                   torch.tensor([0], dtype=torch.int32), sub_chunk=48)
