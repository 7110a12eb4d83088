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
          # with k off the lane count and n off the panel width (AVX2: 24 rows, 64 columns)
          (23, 37, 70), (24, 37, 70), (97, 515, 75),
          # the blocked form with AVX-512 (48 rows, 128 columns), K odd (bf16 pairs: the
          # few-rows form only) and even off the pair vector (a partial last pair vector)
          (47, 258, 150), (100, 515, 150), (100, 258, 150)]


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


def _tree(parts: list[torch.Tensor]) -> torch.Tensor:
    """The lanes' partial sums (float32 values held in float64) added in the fixed tree: with
    16 lanes, lane i + 8 onto lane i first; then adjacent pairs, level by level."""
    if len(parts) == 16:
        parts = [(parts[i] + parts[i + 8]).float().double() for i in range(8)]
    while len(parts) > 1:
        parts = [(a + b).float().double() for a, b in zip(parts[::2], parts[1::2], strict=True)]
    return parts[0].float()


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
    return _tree(parts)


def _pair_sums(x: torch.Tensor, w: torch.Tensor, lanes: int, odd_first: bool = True
               ) -> torch.Tensor:
    """The bf16 pair arithmetic (an AVX512-BF16 host), in float64: lane j takes the pairs of
    k (2p, 2p + 1) for p = j mod `lanes` in ascending p, adding the odd k's product and then
    the even k's, one rounding to float32 each (bf16 products are exact in float64; the
    instruction's DAZ / FTZ never acts on these normal inputs); then `_tree`."""
    k = x.shape[1]
    xd, wd = x.double(), w.double()
    parts = []
    for j in range(lanes):
        acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
        for p in range(j, (k + 1) // 2, lanes):
            order = (2 * p + 1, 2 * p) if odd_first else (2 * p, 2 * p + 1)
            for kk in order:
                if kk < k:
                    acc = (acc + xd[:, kk:kk + 1] * wd[:, kk]).float().double()
        parts.append(acc)
    return _tree(parts)


def _uses_pairs(dtype: torch.dtype) -> bool:
    return f"{dtype}".removeprefix("torch.") + ":dpbf16" in rl.arithmetic()


def _documented(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the module documents for this build and x's dtype, rounded to that dtype."""
    sums = _pair_sums if _uses_pairs(x.dtype) else _lane_sums
    return sums(x, w, rl.lanes()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 60])  # the few-rows form and the blocked form
def test_each_element_is_the_documented_arithmetic(rows, dtype):
    """Both forms compute exactly the arithmetic the module documents for this build
    (`arithmetic()`; float32's is what a link's bits were made of in earlier versions too).
    Negative control: one chain over all k in ascending order (a kernel without lanes)
    differs somewhere (float32: bf16's rounding of the result hides most such differences,
    the next test makes them show)."""
    x, w, _ = _inputs(rows, 300, 140, dtype, seed=5)
    y = rl.rowwise_linear(x, w)
    assert torch.equal(y, _documented(x, w))
    if dtype == torch.float32:
        assert not torch.equal(y, _lane_sums(x, w, 1))


@pytest.mark.parametrize("rows", [1, 60])
def test_bf16_order_of_additions_shows_in_the_result(rows):
    """Inputs whose sum comes out 2 or 4 depending on the order of additions (2^24 + 1 + 2
    rounds to 2^24 + 2 one way, 2^24 + 4 the other; then 2^24 is taken away in another lane):
    the kernel gives what its documented arithmetic gives, and the check is discriminating:
    the pair arithmetic with the even k first, and the float32 lane sums, give 4 where the
    pair arithmetic gives 2."""
    k, n = 64, 140
    x = torch.zeros(rows, k)
    w = torch.zeros(n, k)
    x[:, [0, 32, 33]] = 1.0
    x[:, 2] = -1.0
    w[:, 0] = w[:, 2] = 2.0 ** 24
    w[:, 32], w[:, 33] = 2.0, 1.0
    x, w = x.bfloat16(), w.bfloat16()
    y = rl.rowwise_linear(x, w)
    lanes = rl.lanes()
    assert torch.equal(y, _documented(x, w))
    assert torch.equal(_pair_sums(x, w, lanes), torch.full((rows, n), 2.0))
    assert torch.equal(_pair_sums(x, w, lanes, odd_first=False), torch.full((rows, n), 4.0))
    assert torch.equal(_lane_sums(x, w, lanes), torch.full((rows, n), 4.0))
    expected = 2.0 if _uses_pairs(torch.bfloat16) else 4.0
    assert torch.equal(y, torch.full((rows, n), expected).bfloat16())


def test_arithmetic_names_each_dtype():
    names = dict(part.split(":") for part in rl.arithmetic().split(";"))
    assert set(names) == {"float32", "bfloat16"}
    assert names["float32"] in (f"fma{rl.lanes()}", f"muladd{rl.lanes()}")
    assert names["bfloat16"] in (names["float32"], f"dpbf16x{rl.lanes()}")
