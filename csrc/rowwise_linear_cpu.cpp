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
//   ascending k, one fused multiply-add each (the K tail zero-filled, which adds exact zeros);
// - the lanes added in one fixed pairwise tree, then the bias (float32), then one rounding to
//   the output dtype.
//
// Which other rows and columns share a register block, a work item or a thread changes none
// of it, so any row count, any column count and any thread count give the same bits for a row.
// bf16 inputs are widened to float32 exactly. The lane count is a property of the build
// (-march=native), as the rounding of vLLM's own kernels is of the host's ISA.
//
// bf16 on a host with AVX512-BF16 takes that host's bf16 dot product instead (VDPBF16PS: two
// products per lane and step, twice a float32 FMA's multiply-adds per instruction; measured on
// a Zen 4 host at 1,024 rows: float32 work, the widening form's, takes 2.1-2.8x oneDNN's
// bf16 GEMM, this 1.16-1.39x): 16 lanes, lane j taking the k pairs (2p, 2p + 1) for p = j (mod 16) in ascending
// p, each step adding the odd k's product and then the even k's, each an exact product
// rounded once to nearest even into the float32 lane, bf16 denormals read as zero and float32
// denormal results flushed to zero (the instruction's fixed DAZ / FTZ); then the same tree,
// bias and rounding. Every path of such a host takes it for bf16, so a row's arithmetic is
// still its own; `arithmetic()` names the build's forms (the engine fingerprint holds it).
//
// Two ways to the same bits, chosen by the call's size (which changes no bit, so the choice
// is free): few rows or columns (a decode step, an expert with few tokens, a router) run dot
// products straight from x's and w's rows (`run_rows`: a register block of 3 x 4 elements, each a vector of the
// LANES partial sums); many rows run the blocked form (`run_blocked`, GotoBLAS's blocking
// with the roles that give the same sums): each lane's partial sums of a register tile of MR
// rows x NR columns are one chain of broadcast-times-vector multiply-adds over a lane-major
// packed panel of w (one lane's slice, 8-16 KiB, stays in L1 while every row tile passes) and a
// lane-major packed copy of x; a tile's lanes are then added by the same tree, as vector adds
// across registers. On many rows the first form reads x from L2 for every block of four
// columns (1.13-1.35x torch's MKL GEMM in float32 on an AVX2 host) and widens bf16 w for every
// block of rows; the blocked form packs both operands once per call (1.16-1.20x MKL in
// float32 at K = 256 to 1024 on an AVX2 host, 0.94-1.06x on an AVX-512 host, half the first
// form's time in bf16: docs/benchmarks/rowwise-linear.md).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
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

// v in every lane
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

// A lane's step, the unit both forms repeat over k. `Fma<XT, WT>`: LANES values of k, one
// fused multiply-add each (`fmadd`); `Pairs` (bf16 on an AVX512-BF16 host, the header's second
// arithmetic): 2 * LANES values of k as one VDPBF16PS, lane j holding k = 2j, 2j + 1 of them.
// `at` loads a row's step, `tail` its first n < K values and zeros, `keep` pins a loaded
// vector in a register (`pin`), `mad` adds the products to the lanes.
template <typename XT, typename WT>
struct Fma {
  static constexpr int64_t K = LANES;
  using XV = vf;
  using WV = vf;
  static vf x_at(const XT* p) { return load(p); }
  static vf w_at(const WT* p) { return load(p); }
  static vf x_tail(const XT* p, int64_t n) { return load_tail(p, n); }
  static vf w_tail(const WT* p, int64_t n) { return load_tail(p, n); }
  static void keep(vf& v) { pin(v); }
  static vf mad(vf acc, vf x, vf w) { return fmadd(x, w, acc); }
  // the blocked form's step: one packed slot of x (a float) times a vector of w's columns
  static vf splat_x(float v) { return splat(v); }
  static vf panel_at(const float* p) { return load(p); }
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HC_PAIRS 1
using bh = __m512bh;

struct Pairs {
  static constexpr int64_t K = 2 * LANES;
  using XV = bh;
  using WV = bh;
  static bh x_at(const c10::BFloat16* p) { return (bh)_mm512_loadu_si512(p); }
  static bh w_at(const c10::BFloat16* p) { return x_at(p); }
  static bh x_tail(const c10::BFloat16* p, int64_t n) {
    return (bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
  }
  static bh w_tail(const c10::BFloat16* p, int64_t n) { return x_tail(p, n); }
  // `pin` for pairs ("v": any of the 32 AVX-512 registers)
  static void keep(bh& v) { asm("" : "+v"(v)); }
  static vf mad(vf acc, bh x, bh w) { return (vf)_mm512_dpbf16_ps((__m512)acc, x, w); }
  // a packed slot holds a pair's bits: broadcast as they are
  static bh splat_x(float v) { return (bh)_mm512_set1_ps(v); }
  static bh panel_at(const float* p) { return (bh)_mm512_loadu_si512(p); }
};
#endif

// sums[r * C + c] = the element (r, c) of an R x C block: rows x[r * ldx], columns w[c * ldw],
// in steps of S.
template <typename S, typename XT, typename WT, int R, int C>
void block(const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t k_len, float* sums) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vf{};
  int64_t k = 0;
  for (; k + S::K <= k_len; k += S::K) {
    typename S::XV xv[R];
    for (int r = 0; r < R; ++r) {
      xv[r] = S::x_at(x + r * ldx + k);
      S::keep(xv[r]);
    }
    for (int c = 0; c < C; ++c) {
      typename S::WV wv = S::w_at(w + c * ldw + k);
      S::keep(wv);
      for (int r = 0; r < R; ++r) acc[r][c] = S::mad(acc[r][c], xv[r], wv);
    }
  }
  if (k < k_len) {
    const int64_t n = k_len - k;
    typename S::XV xv[R];
    for (int r = 0; r < R; ++r) xv[r] = S::x_tail(x + r * ldx + k, n);
    for (int c = 0; c < C; ++c) {
      const typename S::WV wv = S::w_tail(w + c * ldw + k, n);
      for (int r = 0; r < R; ++r) acc[r][c] = S::mad(acc[r][c], xv[r], wv);
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

template <typename S, typename XT, typename WT, int R>
void block_rows(const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t k_len, int cols,
                float* sums) {
  switch (cols) {
    case 1: return block<S, XT, WT, R, 1>(x, ldx, w, ldw, k_len, sums);
    case 2: return block<S, XT, WT, R, 2>(x, ldx, w, ldw, k_len, sums);
    case 3: return block<S, XT, WT, R, 3>(x, ldx, w, ldw, k_len, sums);
    default: return block<S, XT, WT, R, CB>(x, ldx, w, ldw, k_len, sums);
  }
}

template <typename S, typename XT, typename WT>
void any_block(const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t k_len, int rows,
               int cols, float* sums) {
  static_assert(CB == 4 && RB >= 2 && RB <= 4, "the switches list 1..3 and RB, CB");
  switch (std::min(rows, RB)) {
    case 1: return block_rows<S, XT, WT, 1>(x, ldx, w, ldw, k_len, cols, sums);
    case 2: return block_rows<S, XT, WT, 2>(x, ldx, w, ldw, k_len, cols, sums);
    case 3: return block_rows<S, XT, WT, 3>(x, ldx, w, ldw, k_len, cols, sums);
    default: return block_rows<S, XT, WT, RB>(x, ldx, w, ldw, k_len, cols, sums);
  }
}

// The step of a call: pairs for a bf16 x on a host with them, else lane-wise FMAs.
template <typename XT, typename T>
#if defined(HC_PAIRS)
using StepOf = std::conditional_t<std::is_same_v<XT, c10::BFloat16>, Pairs, Fma<XT, T>>;
#else
using StepOf = Fma<XT, T>;
#endif

// The few-rows form: x is float32 (a bf16 x is widened once, exactly, for the whole call) or,
// in the bf16 pair arithmetic, bf16; w and y are T.
template <typename XT, typename T>
void run_rows(const XT* x, const T* w, const float* bias, T* y, int64_t m, int64_t n,
              int64_t k) {
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
          any_block<StepOf<XT, T>, XT, T>(x + r * k, k, w + c * k, k, k, rows, cols, sums);
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


// ---- the blocked form (many rows): the same sums, GotoBLAS's blocking ----

constexpr int NV = 2;             // vectors of columns per register tile
constexpr int NR = NV * LANES;    // columns per register tile and per packed panel
#if defined(__AVX512F__)
constexpr int MR = 12;            // 24 accumulators, 2 w vectors, 1 broadcast of 32 registers
#else
constexpr int MR = 6;             // 12 accumulators, 2 w vectors, 1 broadcast of 16 registers
#endif
// calls with fewer rows, or fewer columns, take the few-rows form: packing x costs a pass
// over it, paid back only over several panels (measured: a router's four columns at 1,024
// rows ran 4x slower blocked)
constexpr int64_t BLOCKED_ROWS = 4 * MR;
constexpr int64_t BLOCKED_COLS = 4 * NR;


inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// The i-th leaf of `hsum`'s tree, left to right: the lanes in the order the tree adds them
// (16 lanes: lane i + 8 is lane i's right sibling).
constexpr int lane_at(int i) { return LANES == 16 ? i / 2 + (i % 2) * 8 : i; }

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
// a pair of bf16 as one 32-bit slot (bits moved, not converted)
inline __m256 load8(const uint32_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
// bf16 -> float32 is exact: the bf16 bits are the float's upper half
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// out[j * ldo + i] = src[i][j] for i, j < 8: moves values, computes nothing
template <typename T>
inline void transpose8(const T* const* src, float* out, int64_t ldo) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(src[i]);
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

// A value as a packed slot: float32, widened bf16, or a bf16 pair's bits
inline float slot(float v) { return v; }
inline float slot(c10::BFloat16 v) { return static_cast<float>(v); }
inline float slot(uint32_t v) {
  float f;
  std::memcpy(&f, &v, sizeof(f));
  return f;
}

// Lane-major packing of `rows` rows of src (k apart) into `width` slots per (lane, t):
// out[(j * t_len + t) * width + r] = src[r * k + t * LANES + j] as float32, zero past k and
// for r >= rows. A panel of w is NR slots wide (its columns of y; zeros past n are dropped
// results), a row tile of x MR; zeros past k are the zero-filled tail of the few-rows form.
// Packing moves values and computes nothing.
template <typename T>
void pack_lanes(const T* src, int64_t k, int rows, int width, int64_t t_len, float* out) {
  int64_t t_done = 0;
#if defined(__AVX2__)
  // 8 rows x 8 k's at a time (rows past `rows` read zeros), one group of rows along k after
  // the other so that each row's cache lines are used up in turn; a group of fewer than 8
  // slots goes through `part`
  t_done = k / LANES;
  static const T zeros[8] = {};
  const T* from[8];
  float part[64];
  for (int r0 = 0; r0 < width; r0 += 8) {
    const int slots = std::min(8, width - r0);
    for (int64_t t = 0; t < t_done; ++t)
      for (int h = 0; h < LANES; h += 8) {
        for (int i = 0; i < 8; ++i)
          from[i] = r0 + i < rows ? src + (r0 + i) * k + t * LANES + h : zeros;
        float* to = out + (h * t_len + t) * width + r0;
        if (slots == 8) {
          transpose8(from, to, t_len * width);
          continue;
        }
        transpose8(from, part, 8);
        for (int j = 0; j < 8; ++j)
          std::memcpy(to + j * t_len * width, part + j * 8, sizeof(float) * slots);
      }
  }
#endif
  for (int j = 0; j < LANES; ++j)
    for (int64_t t = t_done; t < t_len; ++t) {
      float* o = out + (j * t_len + t) * width;
      const int64_t kk = t * LANES + j;
      for (int r = 0; r < width; ++r)
        o[r] = r < rows && kk < k ? slot(src[r * k + kk]) : 0.f;
    }
}

// Lane-major copy of x's full row tiles (`pack_lanes`, MR slots), tile i at
// xp[i * LANES * t_len * MR].
template <typename XT>
void pack_x(const XT* x, int64_t k, int64_t tiles, int64_t t_len, float* xp) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      pack_lanes<XT>(x + i * MR * k, k, MR, MR, t_len, xp + i * LANES * t_len * MR);
  });
}

// One lane's partial sums of a full tile: acc[r][v] = the chain over t of S's step with
// x[r]'s slot t (broadcast) and the panel's vector t (xl, wl: the lane's slices), from zero.
// Float32 slots hold one k (fma); with `Pairs` a slot holds a bf16 pair's bits (k = 2p, 2p + 1).
template <typename S>
inline void lane_chain(const float* xl, const float* wl, int64_t t_len, vf (&acc)[MR][NV]) {
  vf a[MR][NV];  // local, so that the loop keeps it in registers
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = vf{};
  for (int64_t t = 0; t < t_len; ++t) {
    typename S::WV wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = S::panel_at(wl + t * NR + v * LANES);
    for (int r = 0; r < MR; ++r) {
      const typename S::XV b = S::splat_x(xl[t * MR + r]);
      for (int v = 0; v < NV; ++v) a[r][v] = S::mad(a[r][v], b, wv[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = a[r][v];
}

// A tile's lane sums folded into the tree as they come: `stack` holds, per tree level, the
// left subtree's sums waiting for their right sibling (a binary counter over the leaves, so
// the additions are `hsum`'s, in its order). True when `acc` is the root (the last leaf).
inline bool fold(int leaf, vf (&acc)[MR][NV], float* stack, int64_t level_stride) {
  int level = 0;
  for (int count = leaf + 1; count % 2 == 0; count /= 2, ++level) {
    const float* left = stack + level * level_stride;
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = load(left + r * NR + v * LANES) + acc[r][v];
  }
  if (leaf + 1 == LANES) return true;
  float* slot = stack + level * level_stride;
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) storev(slot + r * NR + v * LANES, acc[r][v]);
  return false;
}

// y's rows of one tile, columns c0 .. c0 + cols: the tree's root, the bias, one rounding
template <typename T>
inline void finish(const vf (&acc)[MR][NV], const float* bias, T* y, int64_t n, int64_t c0,
                   int cols) {
  if constexpr (std::is_same_v<T, float>) {
    if (cols == NR) {  // a full panel: the same additions, a vector at a time
      vf b[NV] = {};
      if (bias != nullptr)
        for (int v = 0; v < NV; ++v) b[v] = load(bias + c0 + v * LANES);
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v)
          storev(y + r * n + c0 + v * LANES, bias != nullptr ? acc[r][v] + b[v] : acc[r][v]);
      return;
    }
  }
  float out[MR * NR];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) storev(out + r * NR + v * LANES, acc[r][v]);
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < cols; ++c) {
      float s = out[r * NR + c];
      if (bias != nullptr) s = s + bias[c0 + c];
      y[r * n + c0 + c] = static_cast<T>(s);
    }
}

// The rows [0, tiles * MR) of y from the packed x. Work items are panels of NR columns. A
// panel that fits L1 (short k) serves each tile's lanes one after another (the tree's
// partial sums in a small stack); a longer one is taken lane by lane, each lane's slice in
// L1 over every row tile, the partial sums of every tile on a stack per level.
template <typename S, typename T, typename WT>
void run_blocked(const float* xp, int64_t tiles, int64_t t_len, const WT* w, int64_t k,
                 const float* bias, T* y, int64_t n) {
  constexpr int LEVELS = LANES == 16 ? 4 : 3;
  const int64_t panels = (n + NR - 1) / NR;
  const int64_t rows = tiles * MR;
  const bool tile_major = LANES * t_len * NR * 4 <= 16384;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> wp(new float[LANES * t_len * NR]);
    const int64_t level_stride = tile_major ? MR * NR : rows * NR;
    std::unique_ptr<float[]> stack(new float[LEVELS * level_stride]);
    for (int64_t q = begin; q < end; ++q) {
      const int64_t c0 = q * NR;
      const int cols = static_cast<int>(std::min<int64_t>(NR, n - c0));
      pack_lanes<WT>(w + c0 * k, k, cols, NR, t_len, wp.get());
      if (tile_major) {
        for (int64_t i = 0; i < tiles; ++i)
          for (int leaf = 0; leaf < LANES; ++leaf) {
            const int j = lane_at(leaf);
            vf acc[MR][NV];
            lane_chain<S>(xp + (i * LANES + j) * t_len * MR, wp.get() + j * t_len * NR, t_len,
                         acc);
            if (fold(leaf, acc, stack.get(), level_stride))
              finish<T>(acc, bias, y + i * MR * n, n, c0, cols);
          }
        continue;
      }
      for (int leaf = 0; leaf < LANES; ++leaf) {
        const int j = lane_at(leaf);
        const float* wl = wp.get() + j * t_len * NR;
        for (int64_t i = 0; i < tiles; ++i) {
          vf acc[MR][NV];
          lane_chain<S>(xp + (i * LANES + j) * t_len * MR, wl, t_len, acc);
          if (fold(leaf, acc, stack.get() + i * MR * NR, level_stride))
            finish<T>(acc, bias, y + i * MR * n, n, c0, cols);
        }
      }
    }
  });
}

// Rows in full tiles take the blocked form when the call is large enough; the rest (and
// every row of a small call) the few-rows form.
template <typename T>
void run(const float* x, const T* w, const float* bias, T* y, int64_t m, int64_t n, int64_t k) {
  int64_t done = 0;
  if (m >= BLOCKED_ROWS && n >= BLOCKED_COLS) {
    const int64_t tiles = m / MR;
    const int64_t t_len = (k + LANES - 1) / LANES;
    std::unique_ptr<float[]> xp(new float[tiles * LANES * t_len * MR]);
    pack_x<float>(x, k, tiles, t_len, xp.get());
    run_blocked<Fma<float, T>, T, T>(xp.get(), tiles, t_len, w, k, bias, y, n);
    done = tiles * MR;
  }
  if (done < m) run_rows<float, T>(x + done * k, w, bias, y + done * n, m - done, n, k);
}

#if defined(HC_PAIRS)
// bf16 on an AVX512-BF16 host: the pair arithmetic in both forms. The blocked form packs
// pairs as 32-bit slots, so it needs whole pairs in every row (an even K); an odd K runs
// every row in the few-rows form, whose loads take any K.
void run_pairs(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias,
               c10::BFloat16* y, int64_t m, int64_t n, int64_t k) {
  int64_t done = 0;
  if (m >= BLOCKED_ROWS && n >= BLOCKED_COLS && k % 2 == 0) {
    const int64_t k2 = k / 2;
    const int64_t tiles = m / MR;
    const int64_t t_len = (k2 + LANES - 1) / LANES;
    std::unique_ptr<float[]> xp(new float[tiles * LANES * t_len * MR]);
    pack_x<uint32_t>(reinterpret_cast<const uint32_t*>(x), k2, tiles, t_len, xp.get());
    run_blocked<Pairs, c10::BFloat16, uint32_t>(xp.get(), tiles, t_len,
                                               reinterpret_cast<const uint32_t*>(w), k2, bias,
                                               y, n);
    done = tiles * MR;
  }
  if (done < m)
    run_rows<c10::BFloat16, c10::BFloat16>(x + done * k, w, bias, y + done * n, m - done, n, k);
}
#endif

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
#if defined(HC_PAIRS)
    if (x.scalar_type() == torch::kBFloat16) {
      run_pairs(x2.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), bp,
                y.data_ptr<c10::BFloat16>(), m, n, k);
      return y.view(out_sizes);
    }
#endif
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

// The build's arithmetic per dtype, for the engine fingerprint: links made by one arithmetic
// must never be restored into an engine running the other.
std::string arithmetic() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const std::string lane_sums = "fma" + std::to_string(LANES);
#else
  const std::string lane_sums = "muladd" + std::to_string(LANES);  // `fmadd` above
#endif
#if defined(HC_PAIRS)
  return "float32:" + lane_sums + ";bfloat16:dpbf16x" + std::to_string(LANES);
#else
  return "float32:" + lane_sums + ";bfloat16:" + lane_sums;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rowwise_linear", &rowwise_linear,
        "y = x @ w^T (+ bias), each element's arithmetic fixed by its own row and column",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("lanes", &lanes, "partial sums per element (the vector width of this build)");
  m.def("arithmetic", &arithmetic, "the build's arithmetic per dtype (fma or bf16 pairs)");
}
