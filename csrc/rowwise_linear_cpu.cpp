// Row-invariant linear layer for the CPU: y = x @ w^T (+ bias).
//
// Why: Flash-Next's split-invariant forward (docs/split-invariance.md) needs a token's row of
// every GEMM to come out bit for bit the same whatever else the call holds: how many rows the
// forward step has, which rows an expert of the MoE block gets. A BLAS picks its kernel and
// blocking by the problem's shape (measured: a short step's expert GEMMs and GEMMs with one
// or four output columns give other last bits for the same row), so the former form ran every
// GEMM on tiles of exactly 64 rows, padded: sixteen times the calls of a 1024-token step and
// four times the expert rows. Here the arithmetic of an output element is fixed by its own row
// of x and row of w alone:
//
// - LANES partial sums, lane j accumulating x[m, k] * w[n, k] for k = j (mod LANES) in
//   ascending k, one fused multiply-add each (the K tail loaded zero-filled, which adds exact
//   zeros);
// - the lanes added in one fixed pairwise tree, then the bias (float32), then one rounding to
//   the output dtype.
//
// Which other rows and columns share a register block, a work item or a thread changes none
// of it, so any row count, any column count and any thread count give the same bits for a row.
// bf16 inputs are widened to float32 exactly. The lane count is a property of the build
// (-march=native), as the rounding of vLLM's own kernels is of the host's ISA.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "cpu_vectors.h"

namespace {

using hc_cpu::LANES;
using hc_cpu::load;
using hc_cpu::vf;

#if defined(__AVX512F__)
constexpr int RB = 4;  // rows per register block
constexpr int CB = 4;  // columns per register block (16 accumulators of 32 registers)
#else
#ifndef HC_RB
#define HC_RB 3
#endif
constexpr int RB = HC_RB;
constexpr int CB = 4;  // 12 accumulators, 3 x vectors, 1 w vector of 16 registers
#endif
constexpr int64_t ROW_TILE = 64;  // rows of x per work item
constexpr int64_t COL_TILE = 64;  // rows of w per work item

// One fused multiply-add per lane wherever the host has it; elsewhere a multiply and an add
// (built with -ffp-contract=off, so the compiler never fuses some of them and not others).
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// Keeps v in a register: without it GCC folds a vector's load into each multiply-add that
// uses it (R or C loads of one vector per step), and the loop waits on loads, not arithmetic.
inline void pin(vf& v) {
#if defined(__AVX512F__) || defined(__AVX2__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// The first n < LANES elements, the rest zeros.
template <typename T>
inline vf load_tail(const T* p, int64_t n) {
  T buf[LANES];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, n * sizeof(T));
  return load(buf);
}

// The lanes added in one fixed tree: with 16 lanes, lane i + 8 onto lane i first; then
// adjacent pairs, level by level: ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)). `hsum8`
// and `hsum4` compute eight and four such sums at once with the same additions.
inline float hsum(vf v) {
  float a[LANES];
  std::memcpy(a, &v, sizeof(vf));
  int n = LANES;
  if (n == 16) {
    for (int i = 0; i < 8; ++i) a[i] = a[i] + a[i + 8];
    n = 8;
  }
  for (int width = n / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) a[i] = a[2 * i] + a[2 * i + 1];
  return a[0];
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Eight lanes of a (16 lanes: lane i + 8 onto lane i, as `hsum`).
inline __m256 fold8(vf v) {
#if defined(__AVX512F__)
  const __m512 w = (__m512)v;
  const __m256 lo = _mm512_castps512_ps256(w);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1));
  return _mm256_add_ps(lo, hi);
#else
  return (__m256)v;
#endif
}

// out[i] = hsum(v[i]) for i < 8, bit for bit: hadd adds adjacent lanes, twice, then the two
// 128-bit halves are added (x + y is exact to commute).
inline void hsum8(const vf* v, float* out) {
  const __m256 h01 = _mm256_hadd_ps(fold8(v[0]), fold8(v[1]));
  const __m256 h23 = _mm256_hadd_ps(fold8(v[2]), fold8(v[3]));
  const __m256 h45 = _mm256_hadd_ps(fold8(v[4]), fold8(v[5]));
  const __m256 h67 = _mm256_hadd_ps(fold8(v[6]), fold8(v[7]));
  const __m256 q0 = _mm256_hadd_ps(h01, h23);
  const __m256 q1 = _mm256_hadd_ps(h45, h67);
  const __m256 lo = _mm256_permute2f128_ps(q0, q1, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(q0, q1, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

// out[i] = hsum(v[i]) for i < 4, bit for bit (the same additions as hsum8).
inline void hsum4(const vf* v, float* out) {
  const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(fold8(v[0]), fold8(v[1])),
                                  _mm256_hadd_ps(fold8(v[2]), fold8(v[3])));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}
#else
inline void hsum8(const vf* v, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = hsum(v[i]);
}

inline void hsum4(const vf* v, float* out) {
  for (int i = 0; i < 4; ++i) out[i] = hsum(v[i]);
}
#endif

// sums[r * C + c] = the element (r, c) of an R x C block: rows x[r * ldx], columns w[c * ldw].
template <typename XT, typename WT, int R, int C>
void block(const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t k_len, float* sums) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vf{};
  int64_t k = 0;
  for (; k + LANES <= k_len; k += LANES) {
    vf xv[R];
    for (int r = 0; r < R; ++r) {
      xv[r] = load(x + r * ldx + k);
      pin(xv[r]);
    }
    for (int c = 0; c < C; ++c) {
      vf wv = load(w + c * ldw + k);
      pin(wv);
      for (int r = 0; r < R; ++r) acc[r][c] = fmadd(xv[r], wv, acc[r][c]);
    }
  }
  if (k < k_len) {
    const int64_t n = k_len - k;
    vf xv[R];
    for (int r = 0; r < R; ++r) xv[r] = load_tail(x + r * ldx + k, n);
    for (int c = 0; c < C; ++c) {
      const vf wv = load_tail(w + c * ldw + k, n);
      for (int r = 0; r < R; ++r) acc[r][c] = fmadd(xv[r], wv, acc[r][c]);
    }
  }
  // copied out so that acc's address never escapes (it stays in registers in the loop)
  vf flat[R * C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) flat[r * C + c] = acc[r][c];
  int i = 0;
  for (; i + 8 <= R * C; i += 8) hsum8(flat + i, sums + i);
  for (; i + 4 <= R * C; i += 4) hsum4(flat + i, sums + i);
  for (; i < R * C; ++i) sums[i] = hsum(flat[i]);
}

template <typename XT, typename WT, int R>
void block_rows(const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t k_len, int cols,
                float* sums) {
  switch (cols) {
    case 1: return block<XT, WT, R, 1>(x, ldx, w, ldw, k_len, sums);
    case 2: return block<XT, WT, R, 2>(x, ldx, w, ldw, k_len, sums);
    case 3: return block<XT, WT, R, 3>(x, ldx, w, ldw, k_len, sums);
    default: return block<XT, WT, R, CB>(x, ldx, w, ldw, k_len, sums);
  }
}

template <typename XT, typename WT>
void any_block(const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t k_len, int rows,
               int cols, float* sums) {
  static_assert(CB == 4 && RB >= 2 && RB <= 4, "the switches list 1..3 and RB, CB");
  switch (std::min(rows, RB)) {
    case 1: return block_rows<XT, WT, 1>(x, ldx, w, ldw, k_len, cols, sums);
    case 2: return block_rows<XT, WT, 2>(x, ldx, w, ldw, k_len, cols, sums);
    case 3: return block_rows<XT, WT, 3>(x, ldx, w, ldw, k_len, cols, sums);
    default: return block_rows<XT, WT, RB>(x, ldx, w, ldw, k_len, cols, sums);
  }
}

// x is float32 (a bf16 x is widened once, exactly, for the whole call); w and y are T.
template <typename T>
void run(const float* x, const T* w, const float* bias, T* y, int64_t m, int64_t n, int64_t k) {
  const int64_t row_tiles = (m + ROW_TILE - 1) / ROW_TILE;
  const int64_t col_tiles = (n + COL_TILE - 1) / COL_TILE;
  at::parallel_for(0, row_tiles * col_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = (item / col_tiles) * ROW_TILE;
      const int64_t c0 = (item % col_tiles) * COL_TILE;
      const int64_t r1 = std::min(m, r0 + ROW_TILE);
      const int64_t c1 = std::min(n, c0 + COL_TILE);
      float sums[RB * CB];
      for (int64_t c = c0; c < c1; c += CB) {
        const int cols = static_cast<int>(std::min<int64_t>(CB, c1 - c));
        for (int64_t r = r0; r < r1; r += RB) {
          const int rows = static_cast<int>(std::min<int64_t>(RB, r1 - r));
          any_block<float, T>(x + r * k, k, w + c * k, k, k, rows, cols, sums);
          for (int i = 0; i < rows; ++i)
            for (int j = 0; j < cols; ++j) {
              float v = sums[i * cols + j];
              if (bias != nullptr) v = v + bias[c + j];
              y[(r + i) * n + c + j] = static_cast<T>(v);
            }
        }
      }
    }
  });
}

}  // namespace

torch::Tensor rowwise_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must have one dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "float32 or bfloat16 only");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "x [..., K], weight [N, K]");
  const int64_t k = weight.size(1);
  const int64_t n = weight.size(0);
  auto x2 = x.reshape({-1, k}).contiguous();
  auto w = weight.contiguous();
  const int64_t m = x2.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  auto y = torch::empty({m, n}, x.options());
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias [N]");
    b = bias->to(torch::kFloat32).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (m > 0 && n > 0) {
    // bf16 -> float32 is exact: widening x once here leaves every product as it was
    auto xf = x2.to(torch::kFloat32).contiguous();
    if (x.scalar_type() == torch::kFloat32) {
      run<float>(xf.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), m, n, k);
    } else {
      run<c10::BFloat16>(xf.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), bp,
                         y.data_ptr<c10::BFloat16>(), m, n, k);
    }
  }
  return y.view(out_sizes);
}

int lanes() { return LANES; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rowwise_linear", &rowwise_linear,
        "y = x @ w^T (+ bias), each element's arithmetic fixed by its own row and column",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("lanes", &lanes, "partial sums per element (the vector width of this build)");
}
