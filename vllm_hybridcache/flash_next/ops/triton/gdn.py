"""Gated DeltaNet (gated delta rule) kernels: chunked prefill and the recurrent step.

Semantics are HF's ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``
(``use_qk_l2norm_in_kernel=True`` in Flash-Next): per value head ``h`` with key head
``h // (HV // HK)``, state ``S`` (``K x V``, fp32), per token

    S <- exp(g) * S;  S <- S + k (beta * (v - k^T S));  o = (q * scale)^T S

Layout is vLLM's flattened varlen batch: ``q, k: [T, HK, K]``, ``v: [T, HV, V]``,
``g, beta: [T, HV]``, sequences delimited by ``cu_seqlens``; states live in a pool
``state[slot, HV, K, V]`` (fp32) addressed by per-sequence slot indices and are updated in place.

Chunked prefill (one program per sequence x value head x value block) walks the sequence in
chunks, HF's algorithm: inside a chunk the delta-rule updates are folded by the UT transform
``(I + L)^{-1}`` (L strictly lower triangular), computed by forward substitution in
registers; across chunks the state tile ``K x BV`` stays in registers. The kernel's step
(``BT``, from the launch table) divides the 64-token chunk; steps start at the sequence start,
so a prefill split at a multiple of 64 performs the same operations as a single call and the
two agree bit for bit.

The recurrent kernel runs the per-token rule for decode and for MTP verification (several
tokens per sequence); it can also store the state after every token in its own slot, which is
what speculative decoding needs to roll back to the last accepted token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import config_for
from .rounding import round_to

CHUNK = 64


@triton.jit
def _l2norm_rows(x, eps: tl.constexpr):
    """x * rsqrt(sum(x^2) + eps) along the last axis, as HF's ``l2norm`` (fp32)."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps))[:, None]


@triton.jit
def _gdn_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, state_ptr, new_state_ptr,
    cu_ptr, in_slot_ptr, out_slot_ptr, init_ptr,
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk, stride_ns, stride_nh, stride_nk,
    HV: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    KP: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    L2NORM: tl.constexpr, HAS_INIT: tl.constexpr,
):
    n = tl.program_id(0)
    hv = tl.program_id(1)
    pid_v = tl.program_id(2)
    hk = hv // (HV // HK)
    start = tl.load(cu_ptr + n).to(tl.int64)
    length = tl.load(cu_ptr + n + 1).to(tl.int64) - start
    in_slot = tl.load(in_slot_ptr + n).to(tl.int64)
    out_slot = tl.load(out_slot_ptr + n).to(tl.int64)

    offs_k = tl.arange(0, KP)
    mask_k = offs_k < K
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    rows = tl.arange(0, BT)
    mask_kv = mask_k[:, None] & mask_v[None, :]

    # Initial state tile K x BV (zeros when there is no history).
    use_init = in_slot >= 0
    if HAS_INIT:
        use_init = use_init & (tl.load(init_ptr + n) != 0)
    S = tl.zeros([KP, BV], dtype=tl.float32)
    if use_init:
        S = tl.load(state_ptr + in_slot * stride_ss + hv * stride_sh
                    + offs_k[:, None] * stride_sk + offs_v[None, :], mask=mask_kv, other=0.0)

    lower = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)

    for c0 in range(0, length, BT):
        offs_t = c0 + rows
        mask_t = offs_t < length
        tok = start + offs_t
        q = tl.load(q_ptr + tok[:, None] * stride_qt + hk * stride_qh + offs_k[None, :],
                    mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok[:, None] * stride_kt + hk * stride_kh + offs_k[None, :],
                    mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok[:, None] * stride_vt + hv * stride_vh + offs_v[None, :],
                    mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok * stride_gt + hv * stride_gh, mask=mask_t, other=0.0)
        g = g.to(tl.float32)
        beta = tl.load(b_ptr + tok * stride_bt + hv * stride_bh, mask=mask_t, other=0.0)
        beta = beta.to(tl.float32)
        if L2NORM:
            q = _l2norm_rows(q, 1e-6)
            k = _l2norm_rows(k, 1e-6)
        q = q * scale

        gc = tl.cumsum(g, axis=0)  # padded rows have g = 0: gc stays at the last real value
        diff = gc[:, None] - gc[None, :]
        decay = tl.exp(tl.where(causal, diff, 0.0))
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        A = tl.where(lower, beta[:, None] * kk * decay, 0.0)

        # T = (I + A)^{-1} by forward substitution: row i = e_i - A[i, :] @ T (rows < i final).
        Tm = eye
        for i in range(1, BT):
            a_i = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)
            new = tl.sum(a_i[:, None] * Tm, axis=0)
            Tm = tl.where(rows[:, None] == i, eye - new[None, :], Tm)

        egc = tl.exp(gc)
        # v_new = T (v beta) - (T (k beta e^gc)) S, evaluated as T (v beta - (k beta e^gc) S):
        # the same product re-associated, without the BT x K tile T (k beta e^gc), which is
        # what made the kernel spill on RDNA (fp32 products run on FMA units, operands live in
        # registers).
        kbs = tl.dot(k * (beta * egc)[:, None], S, input_precision="ieee")  # [BT, BV]
        v_new = tl.dot(Tm, v * beta[:, None] - kbs, input_precision="ieee")

        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        Aqk = tl.where(causal, qk * decay, 0.0)
        o = tl.dot(q * egc[:, None], S, input_precision="ieee") + tl.dot(
            Aqk, v_new, input_precision="ieee")
        tl.store(o_ptr + tok[:, None] * stride_ot + hv * stride_oh + offs_v[None, :],
                 round_to(o, o_ptr.dtype.element_ty).to(o_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & mask_v[None, :])

        g_last = tl.sum(tl.where(rows == BT - 1, gc, 0.0), axis=0)
        kd = k * tl.exp(g_last - gc)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(kd), v_new, input_precision="ieee")

    if out_slot >= 0:
        tl.store(new_state_ptr + out_slot * stride_ns + hv * stride_nh
                 + offs_k[:, None] * stride_nk + offs_v[None, :], S, mask=mask_kv)


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, state_ptr, new_state_ptr,
    cu_ptr, in_slot_ptr, out_slot_ptr, init_ptr,
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk, stride_ns, stride_nh, stride_nk, stride_outn,
    HV: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    KP: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_INIT: tl.constexpr, PER_TOKEN: tl.constexpr,
):
    n = tl.program_id(0)
    hv = tl.program_id(1)
    pid_v = tl.program_id(2)
    hk = hv // (HV // HK)
    start = tl.load(cu_ptr + n).to(tl.int64)
    length = tl.load(cu_ptr + n + 1).to(tl.int64) - start
    in_slot = tl.load(in_slot_ptr + n).to(tl.int64)

    offs_k = tl.arange(0, KP)
    mask_k = offs_k < K
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    tile = hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    new_tile = hv * stride_nh + offs_k[:, None] * stride_nk + offs_v[None, :]

    use_init = in_slot >= 0
    if HAS_INIT:
        use_init = use_init & (tl.load(init_ptr + n) != 0)
    S = tl.zeros([KP, BV], dtype=tl.float32)
    if use_init:
        S = tl.load(state_ptr + in_slot * stride_ss + tile, mask=mask_kv, other=0.0)

    for t in range(0, length):
        tok = start + t
        q = tl.load(q_ptr + tok * stride_qt + hk * stride_qh + offs_k, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + tok * stride_kt + hk * stride_kh + offs_k, mask=mask_k, other=0.0)
        v = tl.load(v_ptr + tok * stride_vt + hv * stride_vh + offs_v, mask=mask_v, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        g = tl.load(g_ptr + tok * stride_gt + hv * stride_gh).to(tl.float32)
        beta = tl.load(b_ptr + tok * stride_bt + hv * stride_bh).to(tl.float32)
        if L2NORM:
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        q = q * scale
        S = S * tl.exp(g)
        kv_mem = tl.sum(S * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + tok * stride_ot + hv * stride_oh + offs_v,
                 round_to(o, o_ptr.dtype.element_ty).to(o_ptr.dtype.element_ty), mask=mask_v)
        if PER_TOKEN:
            slot_t = tl.load(out_slot_ptr + n * stride_outn + t).to(tl.int64)
            if slot_t >= 0:
                tl.store(new_state_ptr + slot_t * stride_ns + new_tile, S, mask=mask_kv)

    if not PER_TOKEN:
        out_slot = tl.load(out_slot_ptr + n).to(tl.int64)
        if out_slot >= 0:
            tl.store(new_state_ptr + out_slot * stride_ns + new_tile, S, mask=mask_kv)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> None:
    if state.dtype != torch.float32:
        raise ValueError("GDN state pool must be fp32")
    if q.shape != k.shape or q.shape[0] != v.shape[0]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} mismatch")
    if v.shape[1] % k.shape[1] != 0:
        raise ValueError("value heads must be a multiple of key heads")
    if state.shape[1:] != (v.shape[1], k.shape[2], v.shape[2]) or state.stride(-1) != 1:
        raise ValueError(f"state {tuple(state.shape)} does not match [slots, HV, K, V]")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k, v need a contiguous last dimension")


def gdn_chunked_prefill_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    *,
    new_state: torch.Tensor | None = None,
    out_state_slots: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = CHUNK,
    sub_chunk: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over a varlen batch; the state pool is read and written in place.

    Args:
        q, k: ``[T, HK, K]``; v: ``[T, HV, V]``; g (log decay, <= 0) and beta: ``[T, HV]``.
        state: ``[num_slots, HV, K, V]`` fp32 pool.
        cu_seqlens: ``[N+1]`` int32 offsets.
        state_slots: ``[N]`` slot read as the initial state (-1: none).
        has_initial_state: ``[N]`` bool; False starts from zeros (None: every slot >= 0 has one).
        new_state: pool the final states are written to (default: ``state``, in place).
        out_state_slots: ``[N]`` slot in ``new_state`` the final state is written to (default
            ``state_slots``; -1: not written).
        chunk_size: a power of two >= 16 (64 in transformers and here by default).
        sub_chunk: tokens per kernel step, a power of two >= 16 dividing ``chunk_size``
            (default: the launch table's ``BT`` for this chip, capped at ``chunk_size``).
            Sub-chunks are counted from each sequence's first token like chunks, so a prefill
            split at a multiple of ``chunk_size`` still equals a single call bit for bit; the
            result differs from ``chunk_size``-sized chunks only by rounding. Smaller steps
            need fewer registers (see docs/kernels.md).
        scale: query scale, default ``K ** -0.5`` (HF).
        use_qk_l2norm: L2-normalise q and k in fp32 first (Flash-Next: True).
    Returns:
        ``[T, HV, V]`` in ``q.dtype``.
    """
    _check(q, k, v, state)
    if new_state is not None:
        _check(q, k, v, new_state)
    T, HK, K = k.shape
    HV, V = v.shape[1:]
    if out is None:
        out = torch.empty((T, HV, V), dtype=q.dtype, device=q.device)
    N = cu_seqlens.numel() - 1
    if N == 0:
        return out
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    cfg = config_for("gdn_chunk", q.device)
    bt = min(chunk_size, cfg["BT"]) if sub_chunk is None else sub_chunk
    if bt < 16 or bt & (bt - 1) or chunk_size % bt:
        raise ValueError(f"sub_chunk {bt} must be a power of two >= 16 dividing {chunk_size}")
    BV = min(cfg["BV"], max(16, triton.next_power_of_2(V)))
    outs = out_state_slots if out_state_slots is not None else state_slots
    dst = state if new_state is None else new_state
    _gdn_chunk_kernel[(N, HV, triton.cdiv(V, BV))](
        q, k, v, g, beta, out, state, dst,
        cu_seqlens, state_slots, outs,
        has_initial_state if has_initial_state is not None else state_slots,
        K ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2),
        HV=HV, HK=HK, K=K, V=V, KP=max(16, triton.next_power_of_2(K)), BV=BV, BT=bt,
        L2NORM=use_qk_l2norm, HAS_INIT=has_initial_state is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def gdn_recurrent_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    *,
    new_state: torch.Tensor | None = None,
    out_state_slots: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-by-token gated delta rule (decode; several tokens per sequence for MTP verify).

    Same arguments as :func:`gdn_chunked_prefill_varlen`, except ``out_state_slots`` may be
    2-D ``[N, max_tokens]``: then the state after token ``t`` of sequence ``n`` is written to
    slot ``out_state_slots[n, t]`` (-1: skipped), so a verifier can keep the state of the last
    accepted draft token. 1-D (or None) writes only the final state.
    """
    _check(q, k, v, state)
    if new_state is not None:
        _check(q, k, v, new_state)
    T, HK, K = k.shape
    HV, V = v.shape[1:]
    if out is None:
        out = torch.empty((T, HV, V), dtype=q.dtype, device=q.device)
    N = cu_seqlens.numel() - 1
    if N == 0:
        return out
    cfg = config_for("gdn_recurrent", q.device)
    BV = min(cfg["BV"], triton.next_power_of_2(V))
    outs = out_state_slots if out_state_slots is not None else state_slots
    per_token = outs.dim() == 2
    dst = state if new_state is None else new_state
    _gdn_recurrent_kernel[(N, HV, triton.cdiv(V, BV))](
        q, k, v, g, beta, out, state, dst,
        cu_seqlens, state_slots, outs,
        has_initial_state if has_initial_state is not None else state_slots,
        K ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2),
        outs.stride(0) if per_token else 0,
        HV=HV, HK=HK, K=K, V=V, KP=triton.next_power_of_2(K), BV=BV,
        L2NORM=use_qk_l2norm, HAS_INIT=has_initial_state is not None, PER_TOKEN=per_token,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
