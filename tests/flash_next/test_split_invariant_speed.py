"""The cheaper split-invariant attention and indexer scores equal the forms they replaced, bit
for bit (docs/split-invariance.md, "Cost").

The split-invariant attention reduces a tile of queries only over the part of their index
lists that holds selections (the rest is padding whose probabilities are exact zeros), and the
indexer scores only the groups some query of the call can see. Neither may change a single bit:
the old forms (`benchmarks/split_invariant_baseline.py`) are the oracle, on random inputs of
several lengths, both dtypes, selections shorter and longer than the list, padding inside a
list, and through the whole model. Op level: a second or two; the model check: a few seconds.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.split_invariant_baseline import (
    AllGroupScores,
    baseline_forms,
    sparse_attention_full_width,
    tiles_form,
)
from vllm_hybridcache.flash_next.ops import split_invariant as si
from vllm_hybridcache.tools.flash_next_steps import FlashNextStepper, steps_of

from .helpers import prompt_ids


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as bit patterns (NaNs and signed zeros included)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return a.shape == b.shape and torch.equal(a.view(view), b.view(view))


def selections(n: int, budget: int, ratio: int, gen: torch.Generator,
               holes: bool = False) -> torch.Tensor:
    """Index lists as the indexer writes them (ascending positions, -1 padding at the end):
    every position up to the query while it fits the budget, a random subset after that;
    `holes` also turns a few entries inside the lists into -1."""
    width = budget + ratio - 1
    idx = torch.full((n, width), -1, dtype=torch.int32)
    for p in range(n):
        if p + 1 <= width:
            sel = torch.arange(p + 1)
        else:
            sel = torch.sort(torch.randperm(p + 1, generator=gen)[:budget]).values
        idx[p, : sel.numel()] = sel.to(torch.int32)
    if holes:
        idx[torch.rand(idx.shape, generator=gen) < 0.05] = -1
    return idx


CASES = [  # (queries, heads, kv heads, head dim, budget, queries' first position)
    (70, 4, 1, 64, 60, 0),      # flash-next-tiny's shapes: the list is 63 wide, never cut
    (200, 4, 1, 64, 192, 0),    # lists cut at 64, 128, 192 while the prompt is short
    (100, 4, 2, 32, 128, 150),  # a later step: its queries see earlier keys
    (129, 2, 2, 32, 2048, 0),   # a budget far beyond the prompt (flash-next-small's)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}-h{c[1]}-b{c[4]}-at{c[5]}")
@pytest.mark.parametrize("holes", [False, True])
def test_attention_equals_the_full_width_form(case, dtype, holes):
    n, h, hkv, d, budget, first = case
    gen = torch.Generator().manual_seed(n + budget + first)
    keys = first + n
    q = torch.randn(n, h, d, generator=gen).to(dtype)
    k = torch.randn(keys, hkv, d, generator=gen).to(dtype)
    v = torch.randn(keys, hkv, d, generator=gen).to(dtype)
    idx = selections(keys, budget, 4, gen, holes)[first:]
    args = (q, k, v, torch.tensor([0, keys]), torch.zeros(n, dtype=torch.long), idx, 0.125)
    new = si.sparse_attention_per_query(*args)
    assert same_bits(new, sparse_attention_full_width(*args))
    # the cut is per tile: a query's result is the same in a step of its own
    one = si.sparse_attention_per_query(q[-1:], k, v, args[3], args[4][-1:], idx[-1:], 0.125)
    assert same_bits(one[0], new[-1])


def test_attention_cut_is_not_a_no_op():
    """Negative control: the comparison catches a cut that drops a selected entry."""
    gen = torch.Generator().manual_seed(3)
    n, h, d = 130, 2, 32
    q, k, v = (torch.randn(n, h if i == 0 else 1, d, generator=gen) for i in range(3))
    idx = selections(n, 256, 4, gen)
    args = (q, k, v, torch.tensor([0, n]), torch.zeros(n, dtype=torch.long))
    full = sparse_attention_full_width(*args, idx, 0.125)
    assert same_bits(si.sparse_attention_per_query(*args, idx, 0.125), full)
    dropped = idx.clone()
    dropped[-1, 100] = -1  # the last query loses one of its rows
    assert not same_bits(si.sparse_attention_per_query(*args, dropped, 0.125)[-1], full[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 333, 700])
def test_indexer_equals_scoring_every_group(n, dtype):
    """The whole indexer (scores, masks, top-k, ties) picks the same rows as before."""
    gen = torch.Generator().manual_seed(n)
    hi, d, ratio, budget = 2, 64, 4, 60
    q = torch.randn(n, hi, d, generator=gen).to(dtype)
    raw = torch.randn(n, d, generator=gen).to(dtype)
    rope = d // 4
    ang = torch.arange(n)[:, None] * torch.rand(1, rope // 2, generator=gen)
    cos, sin = (torch.cat([f(ang), f(ang)], -1)[:, None].to(dtype) for f in (torch.cos,
                                                                             torch.sin))
    norm = torch.randn(d, generator=gen).to(dtype) * 0.1
    args = (q, raw, torch.tensor([0, n]), torch.zeros(n, dtype=torch.long), torch.arange(n),
            norm, cos[:, 0], sin[:, 0])
    kw = dict(budget=budget, compress_ratio=ratio, eps=1e-6)
    new = si._INDEXER.indexer_topk(*args, **kw)
    old = AllGroupScores().indexer_topk(*args, **kw)
    assert torch.equal(new, old)
    # the scores of the groups a call may see are the same bits
    bk = torch.randn(n // ratio, d, generator=gen)
    groups = n // ratio // 2
    got = si._INDEXER.index_scores(q, bk, groups)[..., :groups]
    assert same_bits(got, AllGroupScores().index_scores(q, bk)[..., :groups])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_prefill_equals_the_old_forms(dtype, embedded_model):
    """flash-next-tiny, split-invariant forward: a cold prefill in two steps leaves the same
    logits, state parts and rows with the current forms as with the old ones."""
    with tiles_form():  # the form these attention and indexer forms belong to
        stepper = FlashNextStepper(embedded_model("flash-next-tiny"), dtype=dtype, ops="cpu",
                                   max_len=512, split_invariant=True)
        ids = prompt_ids(300, seed=5)
        new = stepper.prefill(ids, steps_of(300, 256))
        with baseline_forms():
            old = stepper.prefill(ids, steps_of(300, 256))
    assert si.sparse_attention_per_query is not sparse_attention_full_width  # restored
    assert same_bits(new.logits, old.logits)
    for name, parts in new.sections.items():
        assert all(torch.equal(x, y) for x, y in zip(parts, old.sections[name], strict=True))
    assert all(torch.equal(rows, old.rows[name]) for name, rows in new.rows.items())
