"""QSA indexer top-k and sparse attention against ``ops.reference`` (transformers' semantics).

Indexer: the selection is compared exactly (``torch.equal`` on positions). The pooled keys are
rounded where the reference rounds, so they match to the last bit or within an fp32 ulp (the
RMS reduction order differs); a selection could only differ on a near-tie at the top-k
boundary, which the random test data does not contain (top 4 of up to 32 groups). Exact ties do
occur (with 4 index heads a group scores exactly 0 when every head's dot is negative) and
torch.topk breaks them in an unspecified order; on such rows the test checks that both picks
have the same scores.

Sparse attention: fp32 softmax in both; the kernel keeps q.k and p.v in fp32 and uses an online
softmax (rescaled partial sums), the reference a two-pass softmax, so fp32 outputs agree to
``atol=1e-5, rtol=1e-5``; with bf16 inputs the reference rounds scores and probabilities to
bf16 and the kernel does not, so the bound is a few bf16 ulps (``atol=rtol=2e-2``). Reading the
paged cache equals reading the packed copy bit for bit (same rows, same order).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import RAGGED, cu_seqlens

from vllm_hybridcache.flash_next.ops.reference import (
    ReferenceOps,
    apply_partial_rope,
    rms_norm,
)
from vllm_hybridcache.flash_next.ops.triton.indexer import indexer_topk_varlen, pool_block_keys
from vllm_hybridcache.flash_next.ops.triton.sparse_attn import (
    sparse_attention_packed,
    sparse_attention_paged,
)

REF = ReferenceOps()
HI, DI, R = 4, 32, 8  # 4 index heads, head dim 32, partial RoPE over the first 8 dims
RATIO, BUDGET = 4, 16


def _rope_tables(P: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    freqs = torch.outer(torch.arange(P, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _case(key_lens: list[int], queries: list[tuple[int, int]], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(sum(key_lens), DI, generator=gen).to(dtype)
    q = torch.randn(len(queries), HI, DI, generator=gen).to(dtype)
    w = (torch.randn(DI, generator=gen) * 0.1).to(dtype)
    cos, sin = _rope_tables(max(key_lens) + 1, dtype)
    seq = torch.tensor([n for n, _ in queries], dtype=torch.int32)
    pos = torch.tensor([p for _, p in queries], dtype=torch.int32)
    return q, raw, cu_seqlens(key_lens), seq, pos, w, cos, sin


def _ref_scores(args, t: int) -> torch.Tensor:
    """Group scores of query t computed with the reference's own functions."""
    q, raw, cu, seq, pos, w, cos, sin = args
    n, p = int(seq[t]), int(pos[t])
    keys = raw[cu[n]:cu[n + 1]]
    nb = (p + 1) // RATIO
    pooled = rms_norm(keys[: nb * RATIO].view(nb, RATIO, DI).float().mean(1).to(raw.dtype),
                      w, 1e-6)
    starts = torch.arange(nb) * RATIO
    bk = apply_partial_rope(pooled, cos[starts], sin[starts])
    return torch.relu(q[t].float() @ bk.float().t()).sum(0) / DI ** 0.5


def _assert_same_selection(got: torch.Tensor, ref: torch.Tensor, args) -> None:
    """Equal rows, except where the k-th best score is tied: torch.topk breaks ties in an
    unspecified order (the kernel takes the lower group), so there both selections must pick
    groups with the same scores and the same tail."""
    for t in (got != ref).any(1).nonzero().flatten().tolist():
        scores = _ref_scores(args, t)
        nb = scores.numel()
        sel_g = sorted({int(x) // RATIO for x in got[t] if 0 <= x < nb * RATIO})
        sel_r = sorted({int(x) // RATIO for x in ref[t] if 0 <= x < nb * RATIO})
        assert torch.equal(scores[sel_g].sort().values, scores[sel_r].sort().values), t
        assert torch.equal(got[t][got[t] >= nb * RATIO], ref[t][ref[t] >= nb * RATIO]), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_prefill_ragged_matches_reference(dtype: torch.dtype) -> None:
    """Positions of a ragged batch query their own prefix (a prefill): every third position in
    fp32, every fifth in bf16, and each sequence's last (the interpreter is slow)."""
    lens = RAGGED
    step = 3 if dtype == torch.float32 else 5
    queries = [(n, p) for n, ln in enumerate(lens)
               for p in sorted({*range(0, ln, step), ln - 1})]
    args = _case(lens, queries, dtype, seed=0)
    kw = {"budget": BUDGET, "compress_ratio": RATIO, "eps": 1e-6}
    got = indexer_topk_varlen(*args, **kw)
    ref = REF.indexer_topk(*args, **kw)
    assert got.dtype == torch.int32 and got.shape == (len(queries), BUDGET + RATIO - 1)
    assert (got != ref).any(1).sum() <= 2  # ties are rare: nearly every row is identical
    _assert_same_selection(got, ref, args)


def test_indexer_decode_queries_see_long_history() -> None:
    """Decode: one query per sequence at its last position, histories of 1..200 keys."""
    lens = [1, 63, 64, 65, 200]
    queries = [(n, ln - 1) for n, ln in enumerate(lens)] + [(4, 100)]
    args = _case(lens, queries, torch.float32, seed=1)
    kw = {"budget": BUDGET, "compress_ratio": RATIO, "eps": 1e-6}
    _assert_same_selection(indexer_topk_varlen(*args, **kw), REF.indexer_topk(*args, **kw), args)


def test_indexer_ties_pick_lower_groups() -> None:
    """All groups score 0 (relu of negative dots): the first budget // ratio groups win."""
    lens = [40]
    queries = [(0, 39)]
    q, raw, cu, seq, pos, w, cos, sin = _case(lens, queries, torch.float32, seed=2)
    raw = torch.ones_like(raw)  # every pooled key identical, so every score is equal
    q = -torch.ones_like(q)
    cos, sin = torch.ones_like(cos), torch.zeros_like(sin)  # no rotation: dots stay negative
    got = indexer_topk_varlen(q, raw, cu, seq, pos, w, cos, sin, budget=BUDGET,
                              compress_ratio=RATIO, eps=1e-6)
    expected = list(range(BUDGET)) + [-1] * (RATIO - 1)
    assert got[0].tolist() == expected


def _attn_case(lens: list[int], queries: list[tuple[int, int]], dtype: torch.dtype, seed: int,
               H: int = 4, HKV: int = 2, D: int = 48):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(queries), H, D, generator=gen).to(dtype)
    k = torch.randn(sum(lens), HKV, D, generator=gen).to(dtype)
    v = torch.randn(sum(lens), HKV, D, generator=gen).to(dtype)
    seq = torch.tensor([n for n, _ in queries], dtype=torch.int32)
    width = 24
    idx = torch.full((len(queries), width), -1, dtype=torch.int32)
    for t, (_n, p) in enumerate(queries):
        # A plausible selection: a random subset of the visible prefix, ascending.
        chosen = torch.randperm(p + 1, generator=gen)[: min(width, p + 1)].sort().values
        idx[t, : chosen.numel()] = chosen.to(torch.int32)
    return q, k, v, cu_seqlens(lens), seq, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_matches_reference(dtype: torch.dtype) -> None:
    lens = RAGGED
    queries = [(n, p) for n, ln in enumerate(lens) for p in range(0, ln, 7)]
    q, k, v, cu, seq, idx = _attn_case(lens, queries, dtype, seed=3)
    scale = q.shape[-1] ** -0.5
    got = sparse_attention_packed(q, k, v, cu, seq, idx, scale)
    ref = REF.sparse_attention(q, k, v, cu, seq, idx, scale)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), **tol)


def test_sparse_attention_paged_equals_packed() -> None:
    """The paged cache (shuffled blocks, K and V as views of one row) reads the same rows."""
    lens = [1, 63, 65]
    queries = [(n, ln - 1) for n, ln in enumerate(lens)] + [(1, 10), (2, 64)]
    H, HKV, D, bs = 4, 2, 48, 16
    q, k, v, cu, seq, idx = _attn_case(lens, queries, torch.float32, seed=4, H=H, HKV=HKV, D=D)
    nblocks = sum((ln + bs - 1) // bs for ln in lens) + 3
    rows = torch.zeros(nblocks, bs, 2 * HKV * D + 8)  # [K | V | index key] per token row
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(5)).tolist()
    table = torch.zeros(len(lens), 8, dtype=torch.int32)
    for n, ln in enumerate(lens):
        for b in range((ln + bs - 1) // bs):
            blk = perm.pop()
            table[n, b] = blk
            a, e = int(cu[n]) + b * bs, min(int(cu[n]) + (b + 1) * bs, int(cu[n + 1]))
            rows[blk, : e - a, : HKV * D] = k[a:e].flatten(1)
            rows[blk, : e - a, HKV * D: 2 * HKV * D] = v[a:e].flatten(1)
    k_cache = rows[..., : HKV * D].unflatten(-1, (HKV, D))
    v_cache = rows[..., HKV * D: 2 * HKV * D].unflatten(-1, (HKV, D))
    packed = sparse_attention_packed(q, k, v, cu, seq, idx)
    paged = sparse_attention_paged(q, k_cache, v_cache, table, seq, idx)
    assert torch.equal(paged, packed)


def test_indexer_then_attention_end_to_end() -> None:
    """The indexer's selection feeds attention (what the QSA layer does) and both match."""
    lens = [65, 130]
    queries = [(n, p) for n, ln in enumerate(lens) for p in range(0, ln, 5)]
    qi, raw, cu, seq, pos, w, cos, sin = _case(lens, queries, torch.float32, seed=6)
    kw = {"budget": BUDGET, "compress_ratio": RATIO, "eps": 1e-6}
    idx = indexer_topk_varlen(qi, raw, cu, seq, pos, w, cos, sin, **kw)
    q, k, v, _, _, _ = _attn_case(lens, queries, torch.float32, seed=7)
    got = sparse_attention_packed(q, k, v, cu, seq, idx, 0.125)
    ref = REF.sparse_attention(q, k, v, cu, seq, REF.indexer_topk(qi, raw, cu, seq, pos, w, cos,
                                                                   sin, **kw), 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 3])
def test_sparse_attention_split_rows_match_reference(splits: int) -> None:
    """Decode-style split rows (flash-decoding): rows cut into parts, merged by the combine
    kernel. Trailing -1 padding leaves whole splits empty, which must weigh nothing. Merging
    rescaled partial sums changes rounding only: same tolerance as the unsplit kernel."""
    lens = [1, 65, 130]
    queries = [(n, ln - 1) for n, ln in enumerate(lens)] + [(2, 3)]
    q, k, v, cu, seq, idx = _attn_case(lens, queries, torch.float32, seed=8)
    idx = torch.cat([idx, torch.full((len(queries), 40), -1, dtype=torch.int32)], dim=1)
    got = sparse_attention_packed(q, k, v, cu, seq, idx, 0.2, splits=splits)
    ref = REF.sparse_attention(q, k, v, cu, seq, idx, 0.2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    one = sparse_attention_packed(q, k, v, cu, seq, idx, 0.2, splits=1)
    torch.testing.assert_close(got, one, atol=1e-6, rtol=1e-6)


def test_indexer_paged_keys_equal_packed() -> None:
    """Raw index keys read in place from a paged row cache (shuffled blocks, the key columns
    of a wider row) give the same pooled keys and selections, bit for bit."""
    lens = [3, 65, 130]
    queries = [(n, ln - 1) for n, ln in enumerate(lens)] + [(1, 20), (2, 64)]
    q, raw, cu, seq, pos, w, cos, sin = _case(lens, queries, torch.float32, seed=9)
    bs = 16
    nblocks = sum((ln + bs - 1) // bs for ln in lens) + 2
    rows = torch.zeros(nblocks, bs, 8 + DI)  # [other columns | index key] per token row
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(10)).tolist()
    table = torch.zeros(len(lens), 12, dtype=torch.int32)
    for n, ln in enumerate(lens):
        for b in range((ln + bs - 1) // bs):
            blk = perm.pop()
            table[n, b] = blk
            a, e = int(cu[n]) + b * bs, min(int(cu[n]) + (b + 1) * bs, int(cu[n + 1]))
            rows[blk, : e - a, 8:] = raw[a:e]
    key_cache = rows[..., 8:]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = {"budget": BUDGET, "compress_ratio": RATIO, "eps": 1e-6}
    packed_keys, _, _ = pool_block_keys(raw, cu, w, cos, sin, compress_ratio=RATIO, eps=1e-6)
    paged_keys, _, _ = pool_block_keys(key_cache, None, w, cos, sin, compress_ratio=RATIO,
                                       eps=1e-6, block_table=table, seq_lens=seq_lens)
    assert torch.equal(paged_keys, packed_keys)
    got = indexer_topk_varlen(q, key_cache, None, seq, pos, w, cos, sin, **kw,
                              block_table=table, seq_lens=seq_lens)
    assert torch.equal(got, indexer_topk_varlen(q, raw, cu, seq, pos, w, cos, sin, **kw))
