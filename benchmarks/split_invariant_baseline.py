"""The split-invariant attention and indexer scores as they were before they were made cheaper.

Kept for two uses: `split_invariance_bench --before` runs the split-invariant forward with these
forms in the same run as the current ones (side-by-side cost), and
tests/flash_next/test_split_invariant_speed.py holds the current forms to these bit for bit
(the speed-up must not change a single bit of the forward). Both are the code of
`vllm_hybridcache/flash_next/ops/split_invariant.py` at commit e454e94, unchanged but for the
names: every query reduced over its whole index list (padding included) in tiles of 2^24
elements, and the indexer scoring every group of the sequence for every query.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from vllm_hybridcache.flash_next.ops import split_invariant as si
from vllm_hybridcache.flash_next.ops.reference import ReferenceOps

TILE_ELEMENTS = 1 << 24


def sparse_attention_full_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                key_cu_seqlens: torch.Tensor, query_seq_idx: torch.Tensor,
                                indices: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of each query over its own selected rows only, whole list."""
    t_all, h, d = q.shape
    hkv = k.shape[1]
    rep = h // hkv
    width = indices.shape[1]
    out = torch.empty_like(q)
    base = key_cu_seqlens.to(torch.long)[query_seq_idx.to(torch.long)]
    tile = max(1, TILE_ELEMENTS // max(1, h * width * d))
    for s in range(0, t_all, tile):
        e = min(t_all, s + tile)
        t = e - s
        idx = indices[s:e].to(torch.long)
        valid = idx >= 0
        rows = base[s:e, None] + idx.clamp(min=0)  # [t, L]
        ks = k[rows].float().permute(0, 2, 1, 3)  # [t, Hkv, L, D]
        vs = v[rows].float().permute(0, 2, 1, 3)
        qq = q[s:e].float().view(t, hkv, rep, 1, d)
        scores = (qq * ks.unsqueeze(2)).sum(-1) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).float()
        o = (probs.unsqueeze(-1) * vs.unsqueeze(2)).sum(3)
        out[s:e] = o.reshape(t, h, d).to(q.dtype)
    return out


class AllGroupScores(ReferenceOps):
    """The reference indexer with per-(query, head, group) scores over every group."""

    def index_scores(self, q: torch.Tensor, block_keys: torch.Tensor,
                     groups: int | None = None) -> torch.Tensor:
        del groups  # every group is scored, as before
        t, hi, d = q.shape
        nb = block_keys.shape[0]
        out = torch.empty(t, hi, nb, dtype=torch.float32, device=q.device)
        tile = max(1, TILE_ELEMENTS // max(1, hi * nb * d))
        for s in range(0, t, tile):
            out[s:s + tile] = (q[s:s + tile, :, None, :].float() * block_keys[None, None]
                               ).sum(-1)
        return out


@contextlib.contextmanager
def baseline_forms() -> Iterator[None]:
    """The split-invariant backend runs the forms above while inside (benchmarks only)."""
    saved = si.sparse_attention_per_query, si._INDEXER
    si.sparse_attention_per_query, si._INDEXER = sparse_attention_full_width, AllGroupScores()
    try:
        yield
    finally:
        si.sparse_attention_per_query, si._INDEXER = saved


@contextlib.contextmanager
def tiles_form() -> Iterator[None]:
    """The split-invariant forward in its "tiles" form while inside (64-row GEMM tiles, the
    per-query attention and elementwise indexer scores: where the row-invariant kernel is not
    built), for a model prepared and run inside. The forms above replace that form's."""
    saved = si.rowwise_available
    si.rowwise_available = lambda: False
    try:
        yield
    finally:
        si.rowwise_available = saved
