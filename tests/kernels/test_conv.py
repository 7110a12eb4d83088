"""Causal depthwise conv (GDN conv1d, PLE dilated conv) against HF's torch functions.

Tolerance against HF: outputs are a sum of ``W`` fp32 products; F.conv1d may associate the sum
differently (and use FMA), so fp32 outputs agree to a few ulp (``atol=1e-6, rtol=1e-5``). The
carried state is a copy of inputs and is compared with ``torch.equal``. Two calls over a split
equal one call bit for bit: each output is computed by the same taps in the same order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import RAGGED, cu_seqlens
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    causal_conv1d_fn,
    causal_conv1d_update,
)

from vllm_hybridcache.flash_next.ops.triton.conv import causal_conv1d_varlen

D, W = 40, 4  # 40 channels: not a multiple of the channel block, so masking is exercised.


def _ref_dilated(x_seq: torch.Tensor, state: torch.Tensor, w: torch.Tensor, dil: int,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``_short_conv`` / ``causal_conv1d_update`` semantics for one sequence.

    x_seq ``[L, D]``, state ``[D, S]``; returns (silu(conv) ``[L, D]``, new state ``[D, S]``).
    """
    S = state.shape[-1]
    full = torch.cat([state, x_seq.t()], dim=-1)[None]  # [1, D, S+L]
    out = F.conv1d(full, w.unsqueeze(1), bias, groups=w.shape[0], dilation=dil)
    return F.silu(out)[0].t(), full[0, :, -S:]


@pytest.mark.parametrize("dilation", [1, 3])
def test_prefill_ragged_matches_hf(dilation: int) -> None:
    torch.manual_seed(0)
    lengths = RAGGED
    x = torch.randn(sum(lengths), D)
    w = torch.randn(D, W)
    bias = torch.randn(D) if dilation == 1 else None
    S = (W - 1) * dilation
    state = torch.randn(len(lengths), D, S)
    state0 = state.clone()
    has_init = torch.tensor([False, True, False, True, True])
    slots = torch.arange(len(lengths), dtype=torch.int32)
    cu = cu_seqlens(lengths)
    out = causal_conv1d_varlen(x, w, bias, state, cu, slots, has_init, dilation=dilation)
    for i in range(len(lengths)):
        xs = x[cu[i]:cu[i + 1]]
        init = state0[i] if has_init[i] else torch.zeros(D, S)
        if dilation == 1 and not has_init[i]:
            ref = causal_conv1d_fn(xs.t()[None], w, bias, activation="silu")[0].t()
            _, ref_state = _ref_dilated(xs, init, w, dilation, bias)
        elif dilation == 1:
            st = init[None].clone()
            ref = causal_conv1d_update(xs.t()[None], st, w, bias, activation="silu")[0].t()
            ref_state = st[0]
        else:
            ref, ref_state = _ref_dilated(xs, init, w, dilation, bias)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, atol=1e-6, rtol=1e-5)
        assert torch.equal(state[i], ref_state)


@pytest.mark.parametrize("dilation", [1, 3])
def test_two_calls_equal_one_call(dilation: int) -> None:
    """State carried over a 64-aligned split reproduces the single call bit for bit."""
    torch.manual_seed(1)
    lengths = [65, 130, 64]
    splits = [64, 64, 64]
    x = torch.randn(sum(lengths), D)
    w = torch.randn(D, W)
    S = (W - 1) * dilation
    slots = torch.arange(len(lengths), dtype=torch.int32)
    cu = cu_seqlens(lengths)
    st_one = torch.zeros(len(lengths), D, S)
    out_one = causal_conv1d_varlen(x, w, None, st_one, cu, slots, dilation=dilation)

    st_two = torch.zeros(len(lengths), D, S)
    first = torch.cat([x[cu[i]:cu[i] + splits[i]] for i in range(len(lengths))])
    second = torch.cat([x[cu[i] + splits[i]:cu[i + 1]] for i in range(len(lengths))])
    rest = [n - s for n, s in zip(lengths, splits, strict=True)]
    o1 = causal_conv1d_varlen(first, w, None, st_two, cu_seqlens(splits), slots,
                              torch.zeros(3, dtype=torch.bool), dilation=dilation)
    o2 = causal_conv1d_varlen(second, w, None, st_two, cu_seqlens(rest), slots,
                              torch.ones(3, dtype=torch.bool), dilation=dilation)
    cu1, cu2 = cu_seqlens(splits), cu_seqlens(rest)
    for i in range(len(lengths)):
        joined = torch.cat([o1[cu1[i]:cu1[i + 1]], o2[cu2[i]:cu2[i + 1]]])
        assert torch.equal(joined, out_one[cu[i]:cu[i + 1]])
    assert torch.equal(st_two, st_one)


def test_decode_steps_equal_prefill_and_hf_update() -> None:
    """Token-by-token decode (the update path, also 3 tokens at once for MTP) equals prefill."""
    torch.manual_seed(2)
    w = torch.randn(D, W)
    bias = torch.randn(D)
    x = torch.randn(2, 7, D)
    st_pre = torch.zeros(2, D, W - 1)
    slots = torch.tensor([1, 0], dtype=torch.int32)  # slots need not follow batch order
    ref_out = causal_conv1d_varlen(x.reshape(14, D), w, bias, st_pre, cu_seqlens([7, 7]), slots)

    st = torch.zeros(2, D, W - 1)
    hf_state = torch.zeros(2, D, W - 1)
    outs = []
    for t0, t1 in [(0, 1), (1, 2), (2, 5), (5, 7)]:
        step = x[:, t0:t1].reshape(-1, D)
        n = t1 - t0
        outs.append(causal_conv1d_varlen(step, w, bias, st, cu_seqlens([n, n]), slots)
                    .reshape(2, n, D))
        hf = causal_conv1d_update(x[:, t0:t1].transpose(1, 2), hf_state, w, bias, "silu")
        torch.testing.assert_close(outs[-1], hf.transpose(1, 2), atol=1e-6, rtol=1e-5)
    assert torch.equal(torch.cat(outs, 1), ref_out.reshape(2, 7, D))
    assert torch.equal(st, st_pre)
    assert torch.equal(st[slots.long()], hf_state)


def test_bf16_and_channel_major_strides() -> None:
    """bf16 activations/state with fp32 accumulation; a channel-major x view works unchanged.

    HF computes in the weight dtype: with fp32 weights both round one fp32 result to bf16, so
    they agree within one bf16 ulp (``rtol=8e-3``) where the fp32 sums straddle a rounding
    boundary.
    """
    torch.manual_seed(3)
    L = 65
    xcm = torch.randn(D, L).to(torch.bfloat16)  # [D, L]: vLLM's causal_conv1d_fn layout
    w = torch.randn(D, W)
    st = torch.zeros(1, D, W - 1, dtype=torch.bfloat16)
    out = causal_conv1d_varlen(xcm.t(), w, None, st, cu_seqlens([L]),
                               torch.zeros(1, dtype=torch.int32))
    ref = causal_conv1d_fn(xcm[None], w, None, activation="silu")[0].t()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=8e-3)
    assert torch.equal(st[0], xcm[:, -(W - 1):])


def test_no_slot_means_zero_history_and_no_write() -> None:
    torch.manual_seed(4)
    x = torch.randn(5, D)
    w = torch.randn(D, W)
    st = torch.randn(1, D, W - 1)
    keep = st.clone()
    no_slot = torch.tensor([-1], dtype=torch.int32)
    out = causal_conv1d_varlen(x, w, None, st, cu_seqlens([5]), no_slot)
    ref = causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(st, keep)
