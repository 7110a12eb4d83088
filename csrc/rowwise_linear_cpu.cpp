// Row-invariant linear layer for the CPU: y = x @ w^T (+ bias).
//
// Why: Flash-Next's split-invariant forward (docs/split-invariance.md) needs a token's row of
// every GEMM to come out bit for bit the same whatever else the call holds: how many rows the
// forward step has, which rows an expert of the MoE block gets. A BLAS picks its kernel and
// blocking by the problem's shape (measured: a short step's expert GEMMs and GEMMs with one
// or four output columns give other last bits for the same row), so the former form ran every
// GEMM on tiles of exactly 64 rows, padded. Here the arithmetic of an output element is fixed
// by its own row of x and row of w alone:
//
// - one float32 chain per element: acc = 0, then acc = fma(x[m, k], w[n, k], acc) for k in
//   ascending order, one fused multiply-add (one rounding) per k;
// - then the bias (float32), then one rounding to the output dtype.
//
// Which other rows and columns share a register tile, a cache block, a work item or a thread
// changes none of it (a chain paused at a cache block's end is stored and reloaded as the
// float32 it is), so any row count, any column count, any blocking and any thread count give
// the same bits for a row, and the result does not depend on the build's vector width either.
// bf16 inputs are widened to float32 exactly.
//
// How it is fast: the classic GEMM blocking (GotoBLAS / BLIS) with the roles that give the
// chain above. A register tile is MR rows x NR columns (NR = two vectors): per k, the tile's
// two vectors of w (NR consecutive columns) are loaded from a packed panel, each of the MR
// rows' x[m, k] is broadcast, and every accumulator takes one multiply-add. A panel (KC k's x
// NR columns, 16 KiB) is packed k-major from w's rows (widened from bf16 there) and stays in
// L1 while every row of a block of MC rows (in L2) passes over it. Measured against torch's
// MKL GEMM in benchmarks/rowwise_linear_bench.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <memory>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_vectors.h"

namespace {

using hc_cpu::LANES;
using hc_cpu::vf;

constexpr int NV = 2;                  // vectors of columns per register tile
constexpr int NR = NV * LANES;         // columns per register tile and per packed panel
#if defined(__AVX512F__)
constexpr int MR = 12;                 // 24 accumulators, 2 w vectors, 1 broadcast of 32
#else
constexpr int MR = 6;                  // 12 accumulators, 2 w vectors, 1 broadcast of 16
#endif
constexpr int64_t KC = 4096 / NR;      // k's per packed panel: KC x NR floats = 16 KiB (L1)
constexpr int64_t MC = 32 * MR;        // rows per block of x (MC x KC floats, in L2)
constexpr int64_t PANELS = 8;          // panels per work item at most

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

inline vf splat(float s) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(s);
#elif defined(__AVX2__)
  return (vf)_mm256_set1_ps(s);
#else
  vf v;
  for (int i = 0; i < LANES; ++i) v[i] = s;
  return v;
#endif
}

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// R rows of x (ldx apart, from k0) times P packed panels (kc x NR each, wstride apart). The
// tile's chains are kept at t[p * tstride + r * NR + column]: started at zero on the first
// block of k, continued from t on the others. A full tile is MR rows of one panel; rows short
// of MR (a short call, the last rows) take several panels at once, so that the tile still has
// the accumulators to hide the multiply-add's latency.
template <int R, int P>
void tile(const float* x, int64_t ldx, const float* wp, int64_t wstride, int64_t kc, float* t,
          int64_t tstride, bool first) {
  vf acc[R][P][NV];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < NV; ++v)
        acc[r][p][v] = first ? vf{} : loadv(t + p * tstride + r * NR + v * LANES);
  for (int64_t k = 0; k < kc; ++k) {
    vf wv[P][NV];
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < NV; ++v) wv[p][v] = loadv(wp + p * wstride + k * NR + v * LANES);
    for (int r = 0; r < R; ++r) {
      const vf a = splat(x[r * ldx + k]);
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < NV; ++v) acc[r][p][v] = fmadd(a, wv[p][v], acc[r][p][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < NV; ++v) storev(t + p * tstride + r * NR + v * LANES, acc[r][p][v]);
}

// panels a tile of R rows takes at once: as many accumulators as a full tile, at least one
template <int R>
constexpr int wide() { return MR / R > 0 ? MR / R : 1; }

// `tile<R, P>` for panels = 1..P
template <int R, int P>
void tile_panels(int panels, const float* x, int64_t ldx, const float* wp, int64_t wstride,
                 int64_t kc, float* t, int64_t tstride, bool first) {
  if constexpr (P > 1) {
    if (panels < P)
      return tile_panels<R, P - 1>(panels, x, ldx, wp, wstride, kc, t, tstride, first);
  }
  tile<R, P>(x, ldx, wp, wstride, kc, t, tstride, first);
}

// rows = 1..R (the rows short of a full tile): up to wide<rows>() panels per tile
template <int R>
void tile_rows(int rows, int panels, const float* x, int64_t ldx, const float* wp,
               int64_t wstride, int64_t kc, float* t, int64_t tstride, bool first) {
  if constexpr (R > 1) {
    if (rows < R)
      return tile_rows<R - 1>(rows, panels, x, ldx, wp, wstride, kc, t, tstride, first);
  }
  tile_panels<R, wide<R>()>(panels, x, ldx, wp, wstride, kc, t, tstride, first);
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
// bf16 -> float32 is exact: the bf16 bits are the float's upper half
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// out[j * ldo + i] = rows[i][j] for an 8 x 8 block (row i at src + i * lds)
template <typename T>
inline void transpose8(const T* src, int64_t lds, float* out, int64_t ldo) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(src + i * lds);
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(out + 0 * ldo, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(out + 1 * ldo, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(out + 2 * ldo, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(out + 3 * ldo, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(out + 4 * ldo, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(out + 5 * ldo, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(out + 6 * ldo, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(out + 7 * ldo, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

// The panel of `cols` rows of w (k apart) over k0 .. k0 + kc, k-major: wp[kk * NR + c] =
// w[c * k + k0 + kk] as float32, zero for the columns past `cols` (their results are dropped).
// Packing moves values; it computes nothing, so any way of doing it gives the same panel.
template <typename T>
void pack(const T* w, int64_t k, int64_t k0, int64_t kc, int cols, float* wp) {
  int64_t done = 0;
#if defined(__AVX2__)
  if (cols == NR) {
    // eight rows at a time, along k: each row's cache lines are used up before the next
    const int64_t whole = kc / 8 * 8;
    for (int c = 0; c < NR; c += 8)
      for (int64_t kk = 0; kk < whole; kk += 8)
        transpose8(w + c * k + k0 + kk, k, wp + kk * NR + c, NR);
    done = whole;
  }
#endif
  for (int c = 0; c < cols; ++c) {
    const T* src = w + c * k + k0;
    for (int64_t kk = done; kk < kc; ++kk) wp[kk * NR + c] = widen(src[kk]);
  }
  for (int c = cols; c < NR; ++c)
    for (int64_t kk = 0; kk < kc; ++kk) wp[kk * NR + c] = 0.f;
}

// y[r, c0 + c] = rounded(t[r * NR + c] (+ bias)) for the panel's columns
template <typename T>
void finish(const float* t, const float* bias, T* y, int64_t m, int64_t n, int64_t c0,
            int cols) {
  for (int64_t r = 0; r < m; ++r) {
    const float* src = t + r * NR;
    T* dst = y + r * n + c0;
    if (bias != nullptr) {
      for (int c = 0; c < cols; ++c) dst[c] = static_cast<T>(src[c] + bias[c0 + c]);
    } else {
      for (int c = 0; c < cols; ++c) dst[c] = static_cast<T>(src[c]);
    }
  }
}

// x is float32, rows ldx apart (a bf16 x is widened once, exactly, for the whole call); w and
// y are T. Work items are groups of up to PANELS panels of columns (at least one item per
// thread where there are panels enough); each holds its panels' chains for all m rows.
template <typename T>
void run(const float* x, int64_t ldx, const T* w, const float* bias, T* y, int64_t m,
         int64_t n, int64_t k) {
  const int64_t panels = (n + NR - 1) / NR;
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t per_item =
      std::max<int64_t>(1, std::min<int64_t>(PANELS, (panels + threads - 1) / threads));
  const int64_t items = (panels + per_item - 1) / per_item;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> packed(new float[per_item * KC * NR]);  // uninitialised: written before read
    std::unique_ptr<float[]> chains(new float[per_item * m * NR]);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t q0 = item * per_item;
      const int64_t q1 = std::min(panels, q0 + per_item);
      for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = std::min(KC, k - k0);
        for (int64_t q = q0; q < q1; ++q) {
          const int cols = static_cast<int>(std::min<int64_t>(NR, n - q * NR));
          pack<T>(w + q * NR * k, k, k0, kc, cols, packed.get() + (q - q0) * KC * NR);
        }
        for (int64_t i0 = 0; i0 < m; i0 += MC) {
          const int64_t i1 = std::min(m, i0 + MC);
          const int64_t full = i0 + (i1 - i0) / MR * MR;  // rows in full tiles
          for (int64_t q = q0; q < q1; ++q) {
            const float* wp = packed.get() + (q - q0) * KC * NR;
            float* t = chains.get() + (q - q0) * m * NR;
            for (int64_t r = i0; r < full; r += MR)
              tile<MR, 1>(x + r * ldx + k0, ldx, wp, 0, kc, t + r * NR, 0, k0 == 0);
          }
          if (full < i1) {
            const int rows = static_cast<int>(i1 - full);
            const int64_t step = MR / rows > 0 ? MR / rows : 1;  // wide<rows>()
            for (int64_t q = q0; q < q1; q += step) {
              const int np = static_cast<int>(std::min<int64_t>(step, q1 - q));
              tile_rows<MR - 1>(rows, np, x + full * ldx + k0, ldx,
                                packed.get() + (q - q0) * KC * NR, KC * NR, kc,
                                chains.get() + (q - q0) * m * NR + full * NR, m * NR,
                                k0 == 0);
            }
          }
        }
      }
      for (int64_t q = q0; q < q1; ++q) {
        const int cols = static_cast<int>(std::min<int64_t>(NR, n - q * NR));
        finish<T>(chains.get() + (q - q0) * m * NR, bias, y, m, n, q * NR, cols);
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
  auto x2 = x.reshape({-1, k});
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
    // x as float32 (bf16 widens exactly). Where rows 2 KiB apart or a multiple of it would
    // share the L1 sets the broadcasts read from, and the rows are read for several panels,
    // copied with rows one cache line longer; else read in place
    torch::Tensor xf = x2;
    int64_t ldx = k;
    const bool aliased = k % 512 == 0 && n > 2 * NR;
    if (aliased || x.scalar_type() != torch::kFloat32 || !x2.is_contiguous()) {
      ldx = aliased ? k + 16 : k;
      xf = torch::empty({m, ldx}, x.options().dtype(torch::kFloat32));
      xf.narrow(1, 0, k).copy_(x2);
    }
    if (x.scalar_type() == torch::kFloat32) {
      run<float>(xf.data_ptr<float>(), ldx, w.data_ptr<float>(), bp, y.data_ptr<float>(), m,
                 n, k);
    } else {
      run<c10::BFloat16>(xf.data_ptr<float>(), ldx, w.data_ptr<c10::BFloat16>(), bp,
                         y.data_ptr<c10::BFloat16>(), m, n, k);
    }
  }
  return y.view(out_sizes);
}

// What fixes an element's bits, for the engine fingerprint: the arithmetic, not the blocking
std::string arithmetic() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return "fma-chain-f32";
#else
  return "mul-add-chain-f32";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rowwise_linear", &rowwise_linear,
        "y = x @ w^T (+ bias), each element's arithmetic fixed by its own row and column",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("arithmetic", &arithmetic, "the per-element arithmetic (named in the fingerprint)");
}
