"""Depthwise causal convolution with a carried state: GDN's conv1d and PLE's dilated conv.

One kernel serves four ops: GDN ``causal_conv1d_prefill`` / ``causal_conv1d_update`` (dilation
1, kernel 4, bias optional, SiLU) and PLE ``ple_conv`` prefill / decode (dilation
``ngram_size``, state length ``(kernel-1)*dilation``, SiLU). Decode is prefill of length 1 (or a
few tokens for MTP verification), so there is no separate update kernel to keep in sync.

Layout: activations are token-major ``x[token, channel]`` (vLLM's flattened varlen batch; any
strides are accepted), sequences are delimited by ``cu_seqlens``. The state of a sequence lives
in ``conv_state[slot, channel, S]`` with the most recent input last, as in HF's
``causal_conv1d_update`` and vLLM's mamba conv cache.

Why one program per (sequence, channel block) that walks the sequence: the state of a sequence
must be replaced only after every output that reads the old state is computed. Doing both in
one program needs only a CTA barrier (``tl.debug_barrier``) instead of a second launch. The
arithmetic per output is identical whether an input comes from the state or from ``x``
(taps summed in the same order, fp32), which makes a 2-call prefill bit-identical to a 1-call
prefill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import config_for
from .rounding import round_to


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, state_ptr, new_state_ptr,
    cu_ptr, slot_ptr, out_slot_ptr, init_ptr,
    D,
    stride_xt, stride_xd, stride_ot, stride_od,
    stride_ss, stride_sd, stride_sk,
    stride_ns, stride_nd, stride_nk,
    stride_wd, stride_wk,
    W: tl.constexpr, DIL: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_INIT: tl.constexpr, CAST_X: tl.constexpr,
    BD: tl.constexpr, BT: tl.constexpr,
):
    n = tl.program_id(0)
    pid_d = tl.program_id(1)
    # int64 offsets: T x D can pass 2^31 elements in a long batched prefill.
    start = tl.load(cu_ptr + n).to(tl.int64)
    end = tl.load(cu_ptr + n + 1).to(tl.int64)
    length = end - start
    slot = tl.load(slot_ptr + n).to(tl.int64)
    out_slot = tl.load(out_slot_ptr + n).to(tl.int64)
    # 0/1 as int32: the interpreter rejects masks built from loaded bool scalars.
    use_state = (slot >= 0).to(tl.int32)
    if HAS_INIT:
        use_state = use_state * (tl.load(init_ptr + n) != 0).to(tl.int32)

    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BD], dtype=tl.float32)
    state_base = state_ptr + slot * stride_ss + offs_d * stride_sd

    for t0 in range(0, length, BT):
        offs_t = t0 + tl.arange(0, BT)
        mask_t = offs_t < length
        acc = tl.zeros([BT, BD], dtype=tl.float32) + bias[None, :]
        for i in tl.static_range(W):
            src = offs_t - (W - 1 - i) * DIL
            wi = tl.load(w_ptr + offs_d * stride_wd + i * stride_wk, mask=mask_d, other=0.0)
            from_x = src >= 0
            xv = tl.load(
                x_ptr + (start + src)[:, None] * stride_xt + offs_d[None, :] * stride_xd,
                mask=(from_x & mask_t)[:, None] & mask_d[None, :], other=0.0,
            )
            sv = tl.load(
                state_base[None, :] + (S + src)[:, None] * stride_sk,
                mask=((~from_x) & mask_t & (offs_t * 0 + use_state != 0))[:, None]
                & mask_d[None, :],
                other=0.0,
            )
            # Inputs are cast to the weight dtype first, as transformers runs the conv in it.
            xs = tl.where(from_x[:, None], xv.to(tl.float32), sv.to(tl.float32))
            if CAST_X:
                xs = round_to(xs, w_ptr.dtype.element_ty)
            acc += wi.to(tl.float32)[None, :] * xs
        # transformers rounds the conv result to the weight dtype before the activation.
        acc = round_to(acc, w_ptr.dtype.element_ty)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(
            out_ptr + (start + offs_t)[:, None] * stride_ot + offs_d[None, :] * stride_od,
            round_to(acc, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
            mask=mask_t[:, None] & mask_d[None, :],
        )

    if out_slot >= 0:
        # New state: the last S inputs of (old state ++ x). Gather everything, then barrier,
        # then overwrite: in place (same pool and slot) element j of the new state may read old
        # element j + length.
        offs_k = tl.arange(0, SP)
        mask_k = offs_k < S
        src = length - S + offs_k
        from_x = src >= 0
        xv = tl.load(
            x_ptr + (start + src)[None, :] * stride_xt + offs_d[:, None] * stride_xd,
            mask=mask_d[:, None] & (from_x & mask_k)[None, :], other=0.0,
        )
        sv = tl.load(
            state_base[:, None] + (S + src)[None, :] * stride_sk,
            mask=mask_d[:, None] & ((~from_x) & mask_k & (offs_k * 0 + use_state != 0))[None, :],
            other=0.0,
        )
        new = tl.where(from_x[None, :], xv.to(new_state_ptr.dtype.element_ty),
                       sv.to(new_state_ptr.dtype.element_ty))
        tl.debug_barrier()
        tl.store(new_state_ptr + out_slot * stride_ns + offs_d[:, None] * stride_nd
                 + offs_k[None, :] * stride_nk, new, mask=mask_d[:, None] & mask_k[None, :])


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    *,
    dilation: int = 1,
    activation: str | None = "silu",
    new_state: torch.Tensor | None = None,
    new_state_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv over a flattened varlen batch, carrying the conv state.

    Args:
        x: ``[T, D]`` inputs of all sequences, back to back (any strides).
        weight: ``[D, W]`` taps, oldest first (HF ``conv1d.weight.squeeze(1)``). The conv runs
            in ``weight.dtype`` as transformers does: inputs are cast to it and the result is
            rounded to it before the activation; accumulation is fp32.
        bias: ``[D]`` or None.
        conv_state: ``[num_slots, D, S']`` with ``S' >= S = (W-1)*dilation``; its last ``S``
            columns are the history (most recent last).
        cu_seqlens: ``[N+1]`` offsets into ``x``.
        state_slots: ``[N]`` slot of each sequence in ``conv_state``; -1 means no history.
        has_initial_state: ``[N]`` bool; False treats the history as zeros (a fresh prefill
            into a slot holding stale data). None means every sequence with a slot has one.
        dilation: 1 for GDN, ``ngram_size`` for PLE.
        activation: ``"silu"`` or None.
        new_state, new_state_slots: where the new tail goes (``[slots, D, S'']``, last ``S``
            columns); default: in place, ``conv_state`` at ``state_slots`` (-1: not written).
    Returns:
        ``[T, D]`` outputs in ``x.dtype`` (``out`` if given).
    """
    T, D = x.shape
    W = weight.shape[1]
    S = (W - 1) * dilation
    if conv_state.shape[-1] < S:
        raise ValueError(f"conv_state holds {conv_state.shape[-1]} columns, needs {S}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    # Address the last S columns so wider (speculative) states work unchanged.
    state_view = conv_state[..., conv_state.shape[-1] - S:]
    if new_state is None:
        new_view, new_slots = state_view, state_slots
    else:
        new_view = new_state[..., new_state.shape[-1] - S:]
        new_slots = new_state_slots if new_state_slots is not None else state_slots
    if out is None:
        out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    N = cu_seqlens.numel() - 1
    if N == 0:
        return out
    cfg = config_for("conv", x.device)
    BD = min(cfg["BD"], triton.next_power_of_2(D))
    grid = (N, triton.cdiv(D, BD))
    _conv_kernel[grid](
        x, weight, bias if bias is not None else weight, out, state_view, new_view,
        cu_seqlens, state_slots, new_slots,
        has_initial_state if has_initial_state is not None else state_slots,
        D,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        state_view.stride(0), state_view.stride(1), state_view.stride(2),
        new_view.stride(0), new_view.stride(1), new_view.stride(2),
        weight.stride(0), weight.stride(1),
        W=W, DIL=dilation, S=S, SP=triton.next_power_of_2(max(S, 1)),
        HAS_BIAS=bias is not None, SILU=activation is not None,
        HAS_INIT=has_initial_state is not None,
        CAST_X=weight.element_size() < max(x.element_size(), conv_state.element_size()),
        BD=BD, BT=cfg["BT"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
