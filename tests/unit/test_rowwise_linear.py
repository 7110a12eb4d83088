"""The row-invariant CPU linear (csrc/rowwise_linear_cpu.cpp, ops/rowwise_linear.py): it is a
linear layer (against float64), and a row's output is the same bit for bit whatever other rows
share the call, in whatever order, at any thread count; the check that says so catches a GEMM
whose reduction order follows the call's shape (the negative control)."""

from __future__ import annotations

import pytest
import torch

from vllm_hybridcache.ops import rowwise_linear as rl

pytestmark = pytest.mark.skipif(not rl.available(),
                                reason="the kernel needs a C++ compiler (make toolchain)")

# (rows, in features, out features): K and N off the vector width and the register blocks
SHAPES = [(1, 64, 1), (7, 256, 4), (130, 100, 33), (65, 1024, 96), (300, 8, 3),
          # around the row count where calls switch to the blocked form (4 register tiles),
          # with k off the lane count and n off the panel width
          (23, 37, 70), (24, 37, 70), (97, 515, 75)]


def _inputs(m, k, n, dtype, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _calls_agree(fn, x, w, b) -> bool:
    """Whether every row of `fn` over all of x equals, bit for bit, that row computed in
    calls of other shapes: alone, in a slice starting elsewhere, reversed with the others."""
    full = fn(x, w, b)
    m = x.shape[0]
    parts = [fn(x[i:i + 1], w, b) for i in range(0, m, max(1, m // 5))]
    if not all(torch.equal(p[0], full[i]) for p, i in zip(parts, range(0, m, max(1, m // 5)),
                                                         strict=True)):
        return False
    if m > 3:
        mid = fn(x[1:m - 1], w, b)
        if not torch.equal(mid, full[1:m - 1]):
            return False
    rev = fn(x.flip(0), w, b).flip(0)
    return torch.equal(rev, full)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_is_a_linear_layer(shape, dtype, tol, bias):
    x, w, b = _inputs(*shape, dtype, bias=bias)
    y = rl.rowwise_linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == dtype and y.shape == ref.shape
    assert torch.allclose(y.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_does_not_depend_on_the_call(shape, dtype):
    x, w, b = _inputs(*shape, dtype, seed=1, bias=True)
    assert _calls_agree(rl.rowwise_linear, x, w, b)


def test_thread_count_does_not_change_a_bit():
    x, w, b = _inputs(200, 384, 160, torch.float32, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rl.rowwise_linear(x, w, b)
        torch.set_num_threads(max(2, before))
        many = rl.rowwise_linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_leading_dimensions_and_empty_inputs():
    x, w, _ = _inputs(12, 64, 5, torch.float32, seed=3)
    y = rl.rowwise_linear(x.view(3, 4, 64), w)
    assert y.shape == (3, 4, 5) and torch.equal(y.view(12, 5), rl.rowwise_linear(x, w))
    assert rl.rowwise_linear(x[:0], w).shape == (0, 5)
    with pytest.raises(TypeError):
        rl.rowwise_linear(x, w.to(torch.bfloat16))


def test_negative_control_a_shape_dependent_order_is_caught():
    """A GEMM whose K reduction is split where the call's row count says (as a BLAS picks its
    blocking by shape) gives a row other bits in another call, and the check sees it."""

    def shape_dependent(x, w, b):
        cut = 64 if x.shape[0] > 1 else 128
        return (torch.nn.functional.linear(x[:, :cut], w[:, :cut])
                + torch.nn.functional.linear(x[:, cut:], w[:, cut:]))

    x, w, b = _inputs(40, 512, 64, torch.float32, seed=4)
    assert not _calls_agree(shape_dependent, x, w, b)
    assert rl.lanes() in (8, 16)


def _lane_sums(x: torch.Tensor, w: torch.Tensor, lanes: int) -> torch.Tensor:
    """The documented arithmetic, in float64: lane j sums x[m, k] * w[n, k] for k = j mod
    `lanes` in ascending k, one rounding to float32 per multiply-add (a float32 product is
    exact in float64, so each step is the fused multiply-add's one rounding, but for double
    rounding through float64, which needs a sum within 2^-29 of a float32 tie: not met by
    these inputs); then the lanes added in the fixed tree (16 lanes: lane i + 8 onto lane i
    first, then adjacent pairs, level by level)."""
    k = x.shape[1]
    parts = []
    for j in range(lanes):
        acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
        for kk in range(j, k, lanes):
            acc = (acc + x[:, kk:kk + 1].double() * w[:, kk].double()).float().double()
        parts.append(acc)
    if lanes == 16:
        parts = [(parts[i] + parts[i + 8]).float().double() for i in range(8)]
    while len(parts) > 1:
        parts = [(a + b).float().double() for a, b in zip(parts[::2], parts[1::2], strict=True)]
    return parts[0].float()


@pytest.mark.parametrize("rows", [5, 60])  # the few-rows form and the blocked form
def test_each_element_is_the_documented_lane_sums(rows):
    """Both forms compute exactly the arithmetic the module documents (what a link's bits
    were made of in earlier versions too). Negative control: one chain over all k in
    ascending order (what a kernel without lanes would do) differs somewhere."""
    x, w, _ = _inputs(rows, 300, 72, torch.float32, seed=5)
    y = rl.rowwise_linear(x, w)
    assert torch.equal(y, _lane_sums(x, w, rl.lanes()))
    assert not torch.equal(y, _lane_sums(x, w, 1))
