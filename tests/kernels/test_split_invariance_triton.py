"""The Triton backend's split-invariant mode (docs/split-invariance.md), through the interpreter.

Its two step-dependent launch choices are pinned: attention rows are never split (the automatic
flash-decoding split count follows the step's token count) and the indexer scores with one
fixed tile (the autotuned tile follows the step's group count). The kernels themselves compute
per token, per query or per 64-token chunk counted from the step start, so a query's selection
and attention do not depend on the other queries of its step: checked here by running a prefix
of the queries alone.
"""

from __future__ import annotations

import torch
from kernel_cases import cu_seqlens

from vllm_hybridcache.flash_next.ops import get_backend
from vllm_hybridcache.flash_next.ops.triton import TritonBackend
from vllm_hybridcache.flash_next.ops.triton import backend as triton_backend


def _qsa_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, hi, di, h, hkv, d = 90, 2, 32, 4, 2, 16
    raw = torch.randn(n, di, generator=g)
    iq = torch.randn(n, hi, di, generator=g)
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(n, hkv, d, generator=g)
    v = torch.randn(n, hkv, d, generator=g)
    cos = torch.randn(n, 8, generator=g)
    sin = torch.randn(n, 8, generator=g)
    w = torch.randn(di, generator=g) * 0.1
    return raw, iq, q, k, v, cos, sin, w


def test_switch_gives_a_pinned_triton_backend():
    ops = get_backend("triton", True)
    assert isinstance(ops, TritonBackend) and ops.split_invariant
    assert ops.name == "triton+split_invariant"
    assert not get_backend("triton", False).split_invariant


def test_attention_is_never_split_in_the_invariant_mode(monkeypatch):
    seen = []
    real = triton_backend.sparse_attention_packed

    def spy(*args, **kwargs):
        seen.append(kwargs.get("splits"))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "sparse_attention_packed", spy)
    _, _, q, k, v, _, _, _ = _qsa_case()
    q = q[:4]
    idx = torch.arange(8, dtype=torch.int32).expand(4, 8).clone()
    cu = cu_seqlens([k.shape[0]])
    seq = torch.zeros(4, dtype=torch.int32)
    TritonBackend(split_invariant=True).sparse_attention(q, k, v, cu, seq, idx, 0.25)
    TritonBackend().sparse_attention(q, k, v, cu, seq, idx, 0.25)
    assert seen == [1, None]


def test_a_query_does_not_depend_on_the_rest_of_its_step():
    """Selections and attention of queries 64..89 computed with the whole sequence as their
    step and as a step of their own (keys 0..89 either way) are bit-identical."""
    raw, iq, q, k, v, cos, sin, w = _qsa_case(1)
    ops = TritonBackend(split_invariant=True)
    n = raw.shape[0]
    cu = cu_seqlens([n])
    pos = torch.arange(n)
    seq = torch.zeros(n, dtype=torch.long)
    kw = dict(budget=16, compress_ratio=4, eps=1e-6)
    sel = ops.indexer_topk(iq, raw, cu, seq, pos, w, cos, sin, **kw)
    late = ops.indexer_topk(iq[64:], raw, cu, seq[64:], pos[64:], w, cos, sin, **kw)
    assert torch.equal(sel[64:], late)
    out = ops.sparse_attention(q, k, v, cu, seq, sel, 0.25)
    part = ops.sparse_attention(q[64:], k, v, cu, seq[64:], late, 0.25)
    assert torch.equal(out[64:], part)


def test_the_invariant_mode_makes_its_gemms_row_invariant(monkeypatch):
    """The projections and `hc_mix` run torch's GEMM, whose kernel follows the row count: the
    invariant mode routes every `nn.Linear` and the mix through the split-invariant forward's
    GEMM form (64-row tiles where the row-invariant CPU kernel is not used, as on a GPU); the
    default mode leaves them as they are."""
    from vllm_hybridcache.flash_next.ops import split_invariant
    from vllm_hybridcache.flash_next.ops.reference import ReferenceOps

    monkeypatch.setattr(split_invariant, "rowwise_available", lambda: False)  # the GPU's form
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8))
    TritonBackend().prepare_model(model)
    assert not any(getattr(m, "_row_tiled", False) for m in model)
    TritonBackend(split_invariant=True).prepare_model(model)
    assert all(getattr(m, "_row_tiled", False) for m in model)
    tiles = []
    real = split_invariant.row_tiles

    def spy(fn, x, *args, **kwargs):
        tiles.append(x.shape[0])
        return real(fn, x, *args, **kwargs)

    monkeypatch.setattr(split_invariant, "row_tiles", spy)
    x = torch.randn(70, 32)
    model(x)
    assert tiles == [70, 70]
    g = torch.Generator().manual_seed(3)
    hc, hidden, low = 2, 16, 4
    xs = torch.randn(70, hc * hidden, generator=g)
    args = (torch.ones(hc * hidden), torch.randn(low, hc * hidden, generator=g),
            torch.randn(hc * hidden, low, generator=g), None)
    mixed, _ = TritonBackend(split_invariant=True).hc_mix(xs, *args, hc_count=hc, eps=1e-6)
    assert tiles == [70, 70, 70]
    ref, _ = ReferenceOps().hc_mix(xs, *args, hc_count=hc, eps=1e-6)
    torch.testing.assert_close(mixed, ref)
