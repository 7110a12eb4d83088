"""Sparse attention of each query over the positions its QSA indexer selected.

One program per (query token, kv head) computes all ``G = H / Hkv`` query heads that share the
kv head, so every gathered K/V row is used G times (GQA); the selected positions are walked in
tiles of ``BN`` with an online (flash) softmax in fp32. Matrix products take bf16/fp16 operands
as stored (fp32 accumulation) and fp32 operands at full ``ieee`` precision (never TF32).
Under the interpreter (``UPCAST``) operands are widened to fp32 first, because Triton 3.9's
interpreter computes bf16 ``tl.dot`` incorrectly; bf16 x bf16 products are exact in fp32, so
both paths compute the same products.
The same kernel serves prefill and decode: each query brings its own index row, so there is no
causal mask to build (the indexer only selects visible positions).

K/V addressing has two modes, chosen at compile time:

* packed: ``k, v: [S, Hkv, D]``, sequence ``n`` occupies rows ``key_cu[n] ..`` (the interface
  ``FlashNextOps.sparse_attention``);
* paged: ``k, v: [num_blocks, block_size, Hkv, D]`` (any strides, e.g. views into one row of
  a combined K|V|index-key page) and position ``p`` of sequence ``n`` lives at
  ``block_table[n, p // block_size]``, row ``p % block_size``: vLLM's KV cache, read in place
  without gathering each sequence's history first.

A query with no valid index (padding rows) gets zeros instead of the NaN of a softmax over an
empty set.

Decode batches have few (query, kv head) programs, too few to fill a GPU, so their index rows
are cut into splits computed in parallel (flash-decoding): each split writes its running max,
sum and unnormalised accumulator, and ``_combine_kernel`` merges them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import config_for, interpreting
from .rounding import round_to


@triton.jit
def _sparse_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, idx_ptr, seq_ptr, kcu_ptr, bt_ptr, ml_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_it,
    stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_btn,
    L, block_size, split_len,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    PAGED: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(seq_ptr + t).to(tl.int64)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = hk * G + offs_g
    # Operands stay in their storage dtype: bf16 x bf16 products are exact in the fp32
    # accumulator, so the matrix units give the reference's fp32 scores up to summation order.
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if not PAGED:
        key0 = tl.load(kcu_ptr + n).to(tl.int64)

    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    offs_n = tl.arange(0, BN)
    j_lo = sp * split_len
    j_hi = tl.minimum(L, j_lo + split_len)
    for j0 in range(j_lo, j_hi, BN):
        jm = (j0 + offs_n) < j_hi
        pos = tl.load(idx_ptr + t * stride_it + j0 + offs_n, mask=jm, other=-1).to(tl.int64)
        valid = pos >= 0
        p = tl.maximum(pos, 0)
        if PAGED:
            blk = tl.load(bt_ptr + n * stride_btn + p // block_size, mask=valid, other=0)
            blk = blk.to(tl.int64)
            koff = blk * stride_kb + (p % block_size) * stride_kr
            voff = blk * stride_vb + (p % block_size) * stride_vr
        else:
            koff = (key0 + p) * stride_kb
            voff = (key0 + p) * stride_vb
        kv_mask = valid[:, None] & mask_d[None, :]
        kt = tl.load(k_ptr + koff[:, None] + hk * stride_kh + offs_d[None, :], mask=kv_mask,
                     other=0.0)
        vt = tl.load(v_ptr + voff[:, None] + hk * stride_vh + offs_d[None, :], mask=kv_mask,
                     other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kt), input_precision="ieee")
        s = s * scale  # [GP, BN]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen no valid key yet keep m = -inf; shift by 0 there to avoid NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        pexp = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pexp, axis=1)
        # Probabilities enter the PV product in V's dtype, as the reference casts them to it.
        if UPCAST:
            pv = tl.dot(round_to(pexp, vt.dtype), vt.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pexp.to(vt.dtype), vt, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLIT:
        # Partial result of this split: unnormalised accumulator into o_ptr (the fp32
        # workspace [T, splits, H, D]), running max and sum into ml_ptr ([T, splits, H, 2]).
        nsplit = tl.num_programs(2)
        row = (t * nsplit + sp) * (tl.num_programs(1) * G) + heads
        tl.store(o_ptr + row[:, None] * D + offs_d[None, :], acc,
                 mask=mask_g[:, None] & mask_d[None, :])
        tl.store(ml_ptr + row * 2, m_i, mask=mask_g)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=mask_g)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 round_to(out, o_ptr.dtype.element_ty).to(o_ptr.dtype.element_ty),
                 mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _combine_kernel(
    ws_ptr, ml_ptr, o_ptr, stride_ot, stride_oh,
    H, NSPLIT,
    D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr,
):
    """Merge the splits of one (query, head): rescale each partial by exp(m_s - max m)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, DP)
    ms = offs_s < NSPLIT
    row = (t * NSPLIT + offs_s) * H + h
    m = tl.load(ml_ptr + row * 2, mask=ms, other=float("-inf"))
    l_s = tl.load(ml_ptr + row * 2 + 1, mask=ms, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_safe)  # empty splits (m = -inf) weigh 0
    acc = tl.load(ws_ptr + row[:, None] * D + offs_d[None, :],
                  mask=ms[:, None] & (offs_d < D)[None, :], other=0.0)
    num = tl.sum(w[:, None] * acc, axis=0)
    den = tl.sum(w * l_s, axis=0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d,
             round_to(out, o_ptr.dtype.element_ty).to(o_ptr.dtype.element_ty),
             mask=offs_d < D)


def _auto_splits(programs: int, L: int, bn: int, device: torch.device) -> int:
    """Splits of each index row so that a decode batch fills the chip (flash-decoding).

    With ``programs = T * Hkv`` below twice the compute-unit count, each row is cut into up to
    16 splits of at least two tiles; prefill batches have enough programs and are not split.
    The interpreter does not split by default (tests ask for splits explicitly).
    """
    if interpreting() or device.type != "cuda":
        return 1
    units = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= 2 * units:
        return 1
    return max(1, min(16, triton.cdiv(2 * units, programs), triton.cdiv(L, 2 * bn)))


def _launch(q, k4, v4, indices, query_seq_idx, key_cu, block_table, block_size, scale,
            paged: bool, splits: int | None) -> torch.Tensor:
    T, H, D = q.shape
    hkv = k4.shape[2]
    if H % hkv:
        raise ValueError(f"{H} query heads do not divide into {hkv} kv heads")
    if q.stride(-1) != 1 or k4.stride(-1) != 1 or v4.stride(-1) != 1:
        raise ValueError("q, k, v need a contiguous last dimension")
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    G = H // hkv
    cfg = config_for("sparse_attn", q.device)
    BN = cfg["BN"]
    L = indices.shape[1]
    if splits is None:
        splits = _auto_splits(T * hkv, L, BN, q.device)
    split_len = triton.cdiv(triton.cdiv(L, max(1, splits)), BN) * BN
    splits = max(1, triton.cdiv(L, split_len))
    DP = max(16, triton.next_power_of_2(D))
    if splits > 1:
        ws = torch.empty((T, splits, H, D), dtype=torch.float32, device=q.device)
        ml = torch.empty((T, splits, H, 2), dtype=torch.float32, device=q.device)
        dst, sto, sth = ws, 0, 0
    else:
        ml = out
        dst, sto, sth = out, out.stride(0), out.stride(1)
    _sparse_attn_kernel[(T, hkv, splits)](
        q, k4, v4, dst, indices, query_seq_idx,
        key_cu if key_cu is not None else query_seq_idx,
        block_table if block_table is not None else query_seq_idx, ml,
        scale,
        q.stride(0), q.stride(1), sto, sth, indices.stride(0),
        k4.stride(0), k4.stride(1), k4.stride(2), v4.stride(0), v4.stride(1), v4.stride(2),
        block_table.stride(0) if block_table is not None else 0,
        L, block_size, split_len,
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, DP=DP, PAGED=paged,
        UPCAST=interpreting(), SPLIT=splits > 1, BN=BN,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _combine_kernel[(T, H)](
            ws, ml, out, out.stride(0), out.stride(1), H, splits,
            D=D, DP=DP, SP=triton.next_power_of_2(splits), num_warps=4)
    return out


def sparse_attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cu_seqlens: torch.Tensor,
    query_seq_idx: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """``FlashNextOps.sparse_attention``: q ``[T, H, D]``, k/v ``[S, Hkv, D]`` packed by
    ``key_cu_seqlens``, indices ``[T, L]`` (positions in the query's sequence, -1 = none).
    ``splits``: cut each index row into this many parts merged afterwards (None: automatic,
    see ``_auto_splits``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # A packed row is a page of one token: block stride = row stride.
    k4 = k.unsqueeze(1)
    v4 = v.unsqueeze(1)
    return _launch(q, k4, v4, indices, query_seq_idx, key_cu_seqlens, None, 1, scale,
                   paged=False, splits=splits)


def sparse_attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Sparse attention reading vLLM's paged cache in place.

    k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (views with any strides);
    block_table: ``[N, max_blocks]`` int32; query_seq_idx: ``[T]`` row of ``block_table``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _launch(q, k_cache, v_cache, indices, query_seq_idx, None, block_table,
                   k_cache.shape[1], scale, paged=True, splits=splits)
