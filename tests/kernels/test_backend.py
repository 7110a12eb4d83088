"""``TritonBackend`` op by op against ``ReferenceOps`` through the interface signatures, and the
backend selection per platform.

Tolerances are those of the kernel tests (stated and justified there): fp32 GDN 1e-5 abs /
1e-4 rel, conv and attention 1e-6..1e-5; conv states are copies and compared exactly; index
selections are compared exactly (no ties in this data).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import RAGGED, cu_seqlens

from vllm_hybridcache.flash_next.ops.interface import FlashNextOps
from vllm_hybridcache.flash_next.ops.reference import ReferenceOps
from vllm_hybridcache.flash_next.ops.triton import TritonBackend, TritonOps
from vllm_hybridcache.flash_next.ops.triton.select import (
    ENV_VAR,
    backend_for_platform,
    default_backend_name,
)

REF = ReferenceOps()
TRI = TritonBackend()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_backend_implements_the_interface() -> None:
    assert isinstance(TRI, FlashNextOps) and TritonOps is TritonBackend
    assert TRI.name == "triton"


@pytest.mark.parametrize("with_state", [False, True])
def test_gdn_chunked_prefill(with_state: bool) -> None:
    g = _gen(0)
    lens = [1, 64, 65]
    t, h, dk, dv = sum(lens), 2, 16, 32
    q, k = (torch.randn(t, h, dk, generator=g) for _ in range(2))
    v = torch.randn(t, h, dv, generator=g)
    gg = -torch.rand(t, h, generator=g)
    beta = torch.rand(t, h, generator=g)
    init = torch.randn(len(lens), h, dk, dv, generator=g) if with_state else None
    keep = None if init is None else init.clone()
    cu = cu_seqlens(lens).long()
    out, st = TRI.gdn_chunked_prefill(q, k, v, gg, beta, cu, init)
    ro, rs = REF.gdn_chunked_prefill(q, k, v, gg, beta, cu, init)
    torch.testing.assert_close(out, ro, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(st, rs, atol=1e-5, rtol=1e-4)
    if init is not None:
        assert torch.equal(init, keep)  # functional: inputs untouched


def test_gdn_recurrent_step() -> None:
    g = _gen(1)
    n, h, dk, dv = 3, 4, 16, 8
    q, k = (torch.randn(n, h, dk, generator=g) for _ in range(2))
    v = torch.randn(n, h, dv, generator=g)
    gg, beta = -torch.rand(n, h, generator=g), torch.rand(n, h, generator=g)
    state = torch.randn(n, h, dk, dv, generator=g)
    keep = state.clone()
    out, st = TRI.gdn_recurrent_step(q, k, v, gg, beta, state)
    ro, rs = REF.gdn_recurrent_step(q, k, v, gg, beta, state)
    torch.testing.assert_close(out, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st, rs, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, keep)


@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv1d_prefill_and_update(with_state: bool) -> None:
    g = _gen(2)
    c, kw = 24, 4
    lens = RAGGED
    w = torch.randn(c, kw, generator=g)
    x = torch.randn(sum(lens), c, generator=g)
    st = torch.randn(len(lens), c, kw - 1, generator=g) if with_state else None
    cu = cu_seqlens(lens)
    y, ns = TRI.causal_conv1d_prefill(x, w, cu, st)
    ry, rns = REF.causal_conv1d_prefill(x, w, cu, st)
    torch.testing.assert_close(y, ry, atol=1e-6, rtol=1e-5)
    assert torch.equal(ns, rns)
    xd = torch.randn(len(lens), c, generator=g)
    y2, ns2 = TRI.causal_conv1d_update(xd, w, ns)
    ry2, rns2 = REF.causal_conv1d_update(xd, w, rns)
    torch.testing.assert_close(y2, ry2, atol=1e-6, rtol=1e-5)
    assert torch.equal(ns2, rns2)


def test_causal_conv1d_bf16_weights_round_like_transformers() -> None:
    """bf16 activations and weights: the conv result is rounded to bf16 before SiLU, as in
    transformers; fp32 accumulation vs the CPU conv's may still differ by one bf16 ulp."""
    g = _gen(3)
    c, kw = 16, 4
    w = torch.randn(c, kw, generator=g).to(torch.bfloat16)
    x = torch.randn(70, c, generator=g).to(torch.bfloat16)
    cu = cu_seqlens([70])
    y, ns = TRI.causal_conv1d_prefill(x, w, cu, None)
    ry, rns = REF.causal_conv1d_prefill(x, w, cu, None)
    torch.testing.assert_close(y.float(), ry.float(), atol=1e-2, rtol=8e-3)
    assert torch.equal(ns, rns)


def test_ple_conv() -> None:
    g = _gen(4)
    c, kw, dil = 16, 4, 3
    lens = [1, 63, 65]
    w = torch.randn(c, kw, generator=g)
    x = torch.randn(sum(lens), c, generator=g)
    st = torch.randn(len(lens), c, (kw - 1) * dil, generator=g)
    cu = cu_seqlens(lens)
    for state in (None, st):
        y, ns = TRI.ple_conv(x, w, dil, cu, state)
        ry, rns = REF.ple_conv(x, w, dil, cu, state)
        torch.testing.assert_close(y, ry, atol=1e-6, rtol=1e-5)
        assert torch.equal(ns, rns)


def test_indexer_and_sparse_attention() -> None:
    g = _gen(5)
    lens = [5, 65]
    hi, di, r, ratio, budget = 4, 32, 8, 4, 16
    raw = torch.randn(sum(lens), di, generator=g)
    queries = [(0, 4), (1, 10), (1, 63), (1, 64)]
    iq = torch.randn(len(queries), hi, di, generator=g)
    w = torch.randn(di, generator=g) * 0.1
    inv = 1.0 / (10000.0 ** (torch.arange(0, r, 2).float() / r))
    emb = torch.outer(torch.arange(80).float(), inv)
    cos, sin = torch.cat([emb, emb], -1).cos(), torch.cat([emb, emb], -1).sin()
    cu = cu_seqlens(lens).long()
    seq = torch.tensor([n for n, _ in queries])
    pos = torch.tensor([p for _, p in queries])
    kw = {"budget": budget, "compress_ratio": ratio, "eps": 1e-6}
    sel = TRI.indexer_topk(iq, raw, cu, seq, pos, w, cos, sin, **kw)
    assert torch.equal(sel, REF.indexer_topk(iq, raw, cu, seq, pos, w, cos, sin, **kw))

    h, hkv, d = 4, 1, 32
    q = torch.randn(len(queries), h, d, generator=g)
    kv = torch.randn(sum(lens), 2, hkv, d, generator=g)
    k, v = kv[:, 0], kv[:, 1]  # strided views, as the model slices its cache rows
    out = TRI.sparse_attention(q, k, v, cu, seq, sel, d ** -0.5)
    ref = REF.sparse_attention(q, k, v, cu, seq, sel, d ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_hc_ops_are_torch() -> None:
    g = _gen(6)
    hc, hid, rank = 2, 16, 4
    x = torch.randn(5, hc * hid, generator=g)
    args = (x, torch.randn(hc * hid, generator=g), torch.randn(rank, hc * hid, generator=g),
            torch.randn(hc * hid, rank, generator=g), torch.randn(hc, hc * hid, generator=g))
    a = TRI.hc_mix(*args, hc_count=hc, eps=1e-6)
    b = REF.hc_mix(*args, hc_count=hc, eps=1e-6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    out = torch.randn(5, hid, generator=g)
    assert torch.equal(TRI.hc_inject(x, out, a[1]), REF.hc_inject(x, out, a[1]))


class _Platform:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def is_rocm(self) -> bool:
        return self.kind == "rocm"

    def is_cuda(self) -> bool:
        return self.kind == "cuda"


@pytest.mark.parametrize(("kind", "expected"), [
    ("rocm", "triton"), ("cuda", "triton"), ("cpu", "cpu"), ("xpu", "reference")])
def test_selection_per_platform(kind: str, expected: str, monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert backend_for_platform(_Platform(kind)) == expected
    assert default_backend_name(_Platform(kind)) == expected
    monkeypatch.setenv(ENV_VAR, "reference")
    assert default_backend_name(_Platform(kind)) == "reference"


def test_get_backend_returns_the_triton_backend() -> None:
    """``ops.get_backend("triton")`` finds ``TritonOps`` in this package (lazy export)."""
    from vllm_hybridcache.flash_next.ops import get_backend

    assert isinstance(get_backend("triton"), TritonBackend)


def test_empty_sequences_in_a_batch() -> None:
    """A zero-length sequence keeps its state (or zeros) and produces no rows, as in the
    reference."""
    g = _gen(7)
    lens = [0, 5, 0]
    cu = cu_seqlens(lens)
    h, dk, dv = 2, 16, 16
    q, k = (torch.randn(5, h, dk, generator=g) for _ in range(2))
    v = torch.randn(5, h, dv, generator=g)
    gg, beta = -torch.rand(5, h, generator=g), torch.rand(5, h, generator=g)
    init = torch.randn(3, h, dk, dv, generator=g)
    out, st = TRI.gdn_chunked_prefill(q, k, v, gg, beta, cu, init)
    ro, rs = REF.gdn_chunked_prefill(q, k, v, gg, beta, cu, init)
    torch.testing.assert_close(out, ro, atol=1e-5, rtol=1e-4)
    assert torch.equal(st[0], init[0]) and torch.equal(st[2], init[2])
    torch.testing.assert_close(st, rs, atol=1e-5, rtol=1e-4)
    w = torch.randn(8, 4, generator=g)
    x = torch.randn(5, 8, generator=g)
    cs = torch.randn(3, 8, 3, generator=g)
    y, ns = TRI.causal_conv1d_prefill(x, w, cu, cs)
    # (the reference's F.conv1d rejects an empty sequence, so compare the non-empty one alone)
    ry, rns = REF.causal_conv1d_prefill(x, w, cu_seqlens([5]), cs[1:2])
    torch.testing.assert_close(y, ry, atol=1e-6, rtol=1e-5)
    assert torch.equal(ns[1:2], rns)
    assert torch.equal(ns[0], cs[0]) and torch.equal(ns[2], cs[2])
