"""QSA indexer: pooled block keys, block scores, and top-k token selection.

Semantics (transformers' ``Qwen4ExpTextQSAIndexer``, restated in ``ops.interface``): a query at
position ``pos`` sees ``(pos + 1) // ratio`` complete groups of ``ratio`` raw index keys. Each
group is mean-pooled (fp32 mean, cast back), RMS-normed (``1 + w``), rotated at the group's
first position, and scored ``sum_h relu(q_h . k_b) / sqrt(Di)``. The ``budget // ratio`` best
groups are kept, plus the incomplete tail; the result lists positions ascending, padded with -1.

Three kernels, because their parallelism differs:

1. ``_pool_kernel`` (per sequence x block tile): a group's pooled key depends only on the group,
   so it is computed once per call for every complete group of every sequence, not per query.
   Elementwise steps are rounded to the key dtype where transformers rounds (pooled mean,
   normed key, each RoPE product), so bf16 keys match the reference's bf16 arithmetic.
2. ``_score_kernel`` (per query x block tile): ``q [Hi, Di] @ K_b^T`` on the matrix units, relu,
   sum over heads. Pure function of its inputs, so it is autotuned (tile and warps per chip).
3. ``_topk_kernel`` (per query): exact top-k by a radix search (4 bits per pass, 8 passes) for
   the k-th largest value of the order-preserving integer image of the fp32 scores (tiled, no
   sort and no row-sized register array),
   then one pass that emits the selected groups in ascending order and expands them to token
   positions, followed by the tail. Ties at the threshold go to the lower group index.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import config_for, indexer_score_autotune_configs, interpreting
from .rounding import round_to


@triton.jit
def _key_rows(p, n, key_start, bt_ptr, stride_btn, block_size, stride_kt, stride_kr, mask,
              PAGED: tl.constexpr):
    """Element offsets of the raw keys at positions ``p`` of sequence ``n``: packed rows
    (``key_start + p``) or paged (``block_table[n, p // block_size]``, row ``p % block_size``).
    """
    if PAGED:
        blk = tl.load(bt_ptr + n * stride_btn + p // block_size, mask=mask, other=0)
        return blk.to(tl.int64) * stride_kt + (p % block_size) * stride_kr
    else:
        return (key_start + p) * stride_kt


@triton.jit
def _pool_kernel(
    keys_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    key_cu_ptr, block_cu_ptr, bt_ptr,
    eps,
    stride_kt, stride_kr, stride_ct, stride_st, stride_ot, stride_btn, block_size,
    RATIO: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr, R: tl.constexpr,
    PAGED: tl.constexpr, BB: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    if PAGED:
        key_start = tl.zeros([], dtype=tl.int64)
    else:
        key_start = tl.load(key_cu_ptr + n).to(tl.int64)
    b0 = tl.load(block_cu_ptr + n).to(tl.int64)
    nb = tl.load(block_cu_ptr + n + 1).to(tl.int64) - b0
    offs_b = pid * BB + tl.arange(0, BB)
    mask_b = offs_b < nb
    offs_d = tl.arange(0, DP)
    mask_d = offs_d < DI
    m2 = mask_b[:, None] & mask_d[None, :]
    dt = keys_ptr.dtype.element_ty

    acc = tl.zeros([BB, DP], dtype=tl.float32)
    for r in tl.static_range(RATIO):
        rows = _key_rows(offs_b * RATIO + r, n, key_start, bt_ptr, stride_btn, block_size,
                         stride_kt, stride_kr, mask_b, PAGED)
        acc += tl.load(keys_ptr + rows[:, None] + offs_d[None, :], mask=m2,
                       other=0.0).to(tl.float32)
    pooled = round_to(acc / RATIO, dt)

    var = tl.sum(pooled * pooled, axis=1) / DI
    w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    normed = (pooled * (1.0 / tl.sqrt(var + eps))[:, None] * (1.0 + w)[None, :])
    normed = round_to(normed, dt)

    # Partial RoPE at the group's first position: dims [0, R) rotate, the rest pass through.
    # rotate_half pairs dim i with i + R/2; the partner's normed value is recomputed below
    # (a register tile cannot be permuted cheaply), by the same arithmetic, so it is equal.
    HALF: tl.constexpr = R // 2
    pos = offs_b * RATIO
    in_rope = offs_d < R
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    mr = mask_b[:, None] & in_rope[None, :]
    cos = tl.load(cos_ptr + pos[:, None] * stride_ct + offs_d[None, :], mask=mr, other=0.0)
    sin = tl.load(sin_ptr + pos[:, None] * stride_st + offs_d[None, :], mask=mr, other=0.0)
    acc_p = tl.zeros([BB, DP], dtype=tl.float32)
    for r in tl.static_range(RATIO):
        rows = _key_rows(offs_b * RATIO + r, n, key_start, bt_ptr, stride_btn, block_size,
                         stride_kt, stride_kr, mask_b, PAGED)
        acc_p += tl.load(keys_ptr + rows[:, None] + partner[None, :], mask=mr,
                         other=0.0).to(tl.float32)
    pooled_p = round_to(acc_p / RATIO, dt)
    w_p = tl.load(w_ptr + partner, mask=in_rope, other=0.0).to(tl.float32)
    normed_p = (pooled_p * (1.0 / tl.sqrt(var + eps))[:, None] * (1.0 + w_p)[None, :])
    normed_p = round_to(normed_p, dt)
    rot = sign[None, :] * normed_p  # rotate_half: exact (a sign flip)
    t1 = round_to(normed * cos.to(tl.float32), dt)
    t2 = round_to(rot * sin.to(tl.float32), dt)
    roped = tl.where(in_rope[None, :], t1 + t2, normed)
    tl.store(out_ptr + (b0 + offs_b)[:, None] * stride_ot + offs_d[None, :],
             round_to(roped, dt).to(out_ptr.dtype.element_ty), mask=m2)


# Keyed on the power-of-two bucket of the group count, not the count itself: a new sequence
# length must not trigger a new tuning run while serving.
@triton.autotune(configs=indexer_score_autotune_configs(), key=["NB_BUCKET", "DI", "HI"])
@triton.jit
def _score_kernel(
    q_ptr, bk_ptr, score_ptr,
    seq_ptr, pos_ptr, block_cu_ptr,
    sqrt_d,
    stride_qt, stride_qh, stride_bt, stride_st,
    NB_MAX, NB_BUCKET,
    HI: tl.constexpr, HP: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr,
    RATIO: tl.constexpr, UPCAST: tl.constexpr, BB: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # T x groups can pass 2^31 in a long prefill
    pid = tl.program_id(1)
    n = tl.load(seq_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    b0 = tl.load(block_cu_ptr + n).to(tl.int64)
    ncomplete = (pos + 1) // RATIO
    offs_b = pid * BB + tl.arange(0, BB)
    mask_b = offs_b < ncomplete
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, DP)
    mask_d = offs_d < DI
    # bf16 operands go to the matrix units as stored: their products are exact in the fp32
    # accumulator, i.e. the reference's q.float() @ k.float() up to summation order.
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_h < HI)[:, None] & mask_d[None, :], other=0.0)
    bk = tl.load(bk_ptr + (b0 + offs_b)[:, None] * stride_bt + offs_d[None, :],
                 mask=mask_b[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:  # the interpreter gets bf16 dots wrong; the fp32 products are the same
        s = tl.dot(q.to(tl.float32), tl.trans(bk.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(bk.to(q.dtype)), input_precision="ieee")  # [HP, BB]
    s = tl.sum(tl.maximum(s, 0.0), axis=0) / sqrt_d
    s = tl.where(mask_b, s, float("-inf"))
    tl.store(score_ptr + t * stride_st + offs_b, s, mask=offs_b < NB_MAX)


@triton.jit
def _topk_kernel(
    score_ptr, out_ptr, pos_ptr,
    stride_st, stride_ot,
    TOPK: tl.constexpr, RATIO: tl.constexpr, RP: tl.constexpr, WIDTH: tl.constexpr,
    WP: tl.constexpr, BN: tl.constexpr,
):
    # Scores are compared through their order-preserving int32 image (flip the magnitude bits
    # of negatives), written inline: nested jit calls are costly under the interpreter.
    t = tl.program_id(0).to(tl.int64)  # T x groups can pass 2^31 in a long prefill
    pos = tl.load(pos_ptr + t).to(tl.int64)
    visible = pos + 1
    nblk = visible // RATIO
    k = tl.minimum(nblk, TOPK)
    row = score_ptr + t * stride_st
    offs = tl.arange(0, BN)

    # Largest threshold thr with count(key >= thr) >= k, i.e. the k-th largest key, found
    # most-significant digit first, 4 bits per pass (8 passes over the row): each pass counts
    # the row against the 16 candidate digits at once. (k = 0: nothing is selected below.)
    digits = tl.arange(0, 16).to(tl.int64)
    prefix = tl.zeros([], dtype=tl.int64)  # unsigned image: key + 2^31
    for p in tl.static_range(8):
        cand = prefix + (digits << (28 - 4 * p))
        cnt = tl.zeros([16], dtype=tl.int64)
        for b0 in range(0, nblk, BN):
            m = (b0 + offs) < nblk
            bits = tl.load(row + b0 + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
            u = key + 2147483648
            hit = (u[None, :] >= cand[:, None]) & m[None, :]
            cnt += tl.sum(hit.to(tl.int64), axis=1)
        best = tl.max(tl.where(cnt >= k, digits, 0), axis=0)
        prefix = prefix + (best << (28 - 4 * p))
    thr = prefix - 2147483648

    cnt_gt = tl.zeros([], dtype=tl.int64)
    for b0 in range(0, nblk, BN):
        m = (b0 + offs) < nblk
        bits = tl.load(row + b0 + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        cnt_gt += tl.sum(((key > thr) & m).to(tl.int64), axis=0)
    need_eq = k - cnt_gt

    # Emit the selected groups in ascending order, each expanded to RATIO positions.
    offs_r = tl.arange(0, RP)
    out_row = out_ptr + t * stride_ot
    written = tl.zeros([], dtype=tl.int64)
    eq_seen = tl.zeros([], dtype=tl.int64)
    for b0 in range(0, nblk, BN):
        blk = b0 + offs
        m = blk < nblk
        bits = tl.load(row + blk, mask=m, other=0.0).to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        eq = (key == thr) & m
        eq_rank = eq_seen + tl.cumsum(eq.to(tl.int64), axis=0) - 1
        sel = m & ((key > thr) | (eq & (eq_rank < need_eq)))
        slot = written + tl.cumsum(sel.to(tl.int64), axis=0) - 1
        dst = slot[:, None] * RATIO + offs_r[None, :]
        val = blk[:, None] * RATIO + offs_r[None, :]
        tl.store(out_row + dst, val.to(tl.int32),
                 mask=sel[:, None] & (offs_r < RATIO)[None, :])
        written += tl.sum(sel.to(tl.int64), axis=0)
        eq_seen += tl.sum(eq.to(tl.int64), axis=0)

    # Tail (incomplete group), then -1 padding up to WIDTH.
    offs_w = tl.arange(0, WP)
    first = written * RATIO
    ntail = visible - nblk * RATIO
    tail_pos = nblk * RATIO + (offs_w - first)
    val = tl.where((offs_w >= first) & (offs_w < first + ntail), tail_pos, -1)
    tl.store(out_row + offs_w, val.to(tl.int32), mask=(offs_w >= first) & (offs_w < WIDTH))


def pool_block_keys(
    raw_keys: torch.Tensor,
    key_cu_seqlens: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    compress_ratio: int,
    eps: float,
    block_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pooled, normed, rotated key of every complete group of every sequence.

    Packed: ``raw_keys [S, Di]`` by ``key_cu_seqlens``. Paged: ``raw_keys [blocks,
    block_size, Di]`` (a view with any strides, e.g. the index-key columns of the QSA row
    page), ``block_table [N, max_blocks]`` and ``seq_lens [N]``.
    Returns (block_keys ``[sum_n len_n // ratio, Di]`` in ``raw_keys.dtype``, group offsets
    ``[N+1]`` int32, max groups in one sequence). The group counts are read on the host (one
    synchronisation) to size the output and the grid.
    """
    paged = block_table is not None
    DI = raw_keys.shape[-1]
    if paged:
        if seq_lens is None:
            raise ValueError("the paged layout needs seq_lens")
        lens = seq_lens.to(torch.int64)
    else:
        lens = (key_cu_seqlens[1:] - key_cu_seqlens[:-1]).to(torch.int64)
    nblocks = lens // compress_ratio
    block_cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=raw_keys.device)
    block_cu[1:] = nblocks.cumsum(0)
    nb_max = int(nblocks.max()) if nblocks.numel() else 0
    total = int(block_cu[-1])
    out = torch.empty((total, DI), dtype=raw_keys.dtype, device=raw_keys.device)
    if total == 0:
        return out, block_cu, 0
    R = cos.shape[-1]
    if raw_keys.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("raw_keys, cos and sin need a contiguous last dimension")
    cfg = config_for("indexer_pool", raw_keys.device)
    BB = cfg["BB"]
    _pool_kernel[(lens.numel(), triton.cdiv(nb_max, BB))](
        raw_keys, k_norm_weight, cos, sin, out,
        key_cu_seqlens if not paged else block_cu, block_cu,
        block_table if paged else block_cu, eps,
        raw_keys.stride(0), raw_keys.stride(1) if paged else 0, cos.stride(0), sin.stride(0),
        out.stride(0), block_table.stride(0) if paged else 0,
        raw_keys.shape[1] if paged else 1,
        RATIO=compress_ratio, DI=DI, DP=max(16, triton.next_power_of_2(DI)), R=R,
        PAGED=paged, BB=BB, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, block_cu, nb_max


def indexer_topk_varlen(
    q: torch.Tensor,
    raw_keys: torch.Tensor,
    key_cu_seqlens: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_pos: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    budget: int,
    compress_ratio: int,
    eps: float,
    block_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    pinned_score_tile: bool = False,
) -> torch.Tensor:
    """QSA selection (``ops.interface.FlashNextOps.indexer_topk``): ``[T, budget+ratio-1]``.

    With ``block_table`` and ``seq_lens`` (and ``key_cu_seqlens=None``) ``raw_keys`` is the
    paged cache ``[blocks, block_size, Di]``, read in place (see :func:`pool_block_keys`).
    ``pinned_score_tile``: score with one fixed tile instead of the autotuned one, whose choice
    follows the group count of the step's sequences (split-invariant mode: a query's scores
    must not depend on how many keys its step's sequence holds).
    """
    T, HI, DI = q.shape
    ratio = compress_ratio
    width = budget + ratio - 1
    out = torch.full((T, width), -1, dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dimension")
    block_keys, block_cu, nb_max = pool_block_keys(
        raw_keys, key_cu_seqlens, k_norm_weight, cos, sin, compress_ratio=ratio, eps=eps,
        block_table=block_table, seq_lens=seq_lens)
    nb_cols = max(nb_max, 1)
    scores = torch.empty((T, nb_cols), dtype=torch.float32, device=q.device)
    if nb_max > 0:
        def grid(meta: dict) -> tuple[int, int]:
            return (T, triton.cdiv(nb_cols, meta["BB"]))

        args = (q, block_keys, scores, query_seq_idx, query_pos, block_cu,
                math.sqrt(DI),
                q.stride(0), q.stride(1), block_keys.stride(0), scores.stride(0),
                nb_cols, triton.next_power_of_2(nb_cols))
        consts = dict(HI=HI, HP=max(16, triton.next_power_of_2(HI)), DI=DI,
                      DP=max(16, triton.next_power_of_2(DI)), RATIO=ratio,
                      UPCAST=interpreting())
        if pinned_score_tile:
            pinned = indexer_score_autotune_configs()[0]
            _score_kernel.fn[grid(pinned.kwargs)](
                *args, **consts, **pinned.kwargs, num_warps=pinned.num_warps,
                num_stages=pinned.num_stages)
        else:
            _score_kernel[grid](*args, **consts)
    cfg = config_for("indexer_topk", q.device)
    _topk_kernel[(T,)](
        scores, out, query_pos, scores.stride(0), out.stride(0),
        TOPK=budget // ratio, RATIO=ratio, RP=triton.next_power_of_2(ratio), WIDTH=width,
        WP=triton.next_power_of_2(width), BN=cfg["BN"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
