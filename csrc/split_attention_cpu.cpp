// Split-invariant paged attention for vLLM's CPU KV cache (the `vec` layout).
//
// Why: fine segmentation captures links at 64-aligned positions inside a prefill step, so a
// query's attention output must not depend on the step it is computed in
// (docs/split-invariance.md). vLLM 0.32's CPU attention sizes its key tiles from the query tile
// a query lands in, and the query tiles follow the step; pinning it to one-round query tiles
// makes every tile read the request's keys again (1.42x a turn after a long context). Here
// every query's arithmetic is fixed by its own position alone:
//
// - keys are visited in tiles of KV_TILE keys counted from key 0 of the request, in order;
// - a score is one dot product over the head dimension, accumulated in dimension order, per
//   (query row, key) in its own vector lane; which other rows share the register block does
//   not change it;
// - per tile, the row's maximum (exact in any order), probabilities exp(s - max) with masked
//   keys exactly 0 over the whole tile, their sum over the tile's lanes in a fixed order, and
//   P @ V over the row's own visible keys in key order; the running output is rescaled once per
//   tile (online softmax).
//
// A query tile holds up to Q_TILE consecutive tokens of one request and one KV head, so the
// keys a tile visits are read once for all its rows. Work items (request, KV head, query tile)
// run in parallel; nothing a row computes depends on the item's other rows or on the thread.
//
// Layout (vLLM's `vec` ISA, csrc/cpu/cpu_attn_vec.hpp of vLLM): a cache block of one KV head
// holds the keys as [head_dim, block_size] (key t, dim d at d * block_size + t) followed by the
// values as [block_size, head_dim]; `key_cache` / `value_cache` are the views the backend makes
// of them ([num_blocks, kv_heads, block_size, head_dim], strided).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vectors.h"

namespace {

using hc_cpu::LANES;
using hc_cpu::load;
using hc_cpu::vf;
using hc_cpu::vi;

// The vector type is the host's (cpu_vectors.h: 16 float lanes with AVX-512, 8 otherwise),
// and the register block is sized to fit its registers.
#if defined(__AVX512F__)
#ifndef HC_ROW_BLOCK
#define HC_ROW_BLOCK 8
#endif
#else
#ifndef HC_ROW_BLOCK
#define HC_ROW_BLOCK 3
#endif
#endif
constexpr int KV_UNIT = 32;    // keys per scoring unit (vLLM's block sizes are multiples of 32)
constexpr int VPU = KV_UNIT / LANES;  // vectors per unit of keys
#ifndef HC_KV_TILE
#define HC_KV_TILE 128
#endif
#ifndef HC_Q_TILE
#define HC_Q_TILE 32
#endif
constexpr int KV_TILE = HC_KV_TILE;   // keys per softmax tile, counted from key 0
constexpr int UNITS = KV_TILE / KV_UNIT;
#ifndef HC_WIDEN_ROWS
#define HC_WIDEN_ROWS 16
#endif
constexpr int WIDEN_ROWS = HC_WIDEN_ROWS;  // rows from which a tile's keys and values are
                                           // widened to float32 once for all of them
constexpr int ROW_BLOCK = HC_ROW_BLOCK;  // rows per register block (score and P @ V loops):
                                         // the accumulators fill the host's vector registers
constexpr int Q_TILE = HC_Q_TILE;     // query tokens per work item

inline vf splat(float x) { return vf{} + x; }

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// exp by range reduction x = n ln2 + r, a degree-6 polynomial for e^r on |r| <= ln2 / 2 and
// 2^n built in the exponent bits; -inf gives exactly 0. One code path for every lane.
inline vf vexp(vf x) {
  const vf lo = splat(-87.3f), hi = splat(88.3f);
  vi neg_inf = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // round to nearest (even) by the 1.5 * 2^23 shift: exact for |x log2 e| < 2^22
  vf n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  vf out = p * scale;
  return neg_inf ? splat(0.0f) : out;
}

inline float hsum(vf v) {
  // a fixed pairwise tree over the lanes
  float t[LANES];
  std::memcpy(t, &v, sizeof(t));
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
  return t[0];
}

inline float hmax(vf v) {
  float t[LANES];
  std::memcpy(t, &v, sizeof(t));
  float m = t[0];
  for (int i = 1; i < LANES; ++i) m = t[i] > m ? t[i] : m;
  return m;
}

template <typename kv_t>
struct Cache {
  const kv_t* key;
  const kv_t* value;
  int64_t block_stride;  // elements between blocks
  int64_t head_stride;   // elements between KV heads of a block
  int64_t block_size;
  const int32_t* table;  // this request's block-table row
};

// Scores of N query rows (fp32, scaled, [N, D] at `q`) against one unit of KV_UNIT keys at
// `kp` (dimension d of key j at kp[d * block_size + j]): out[i * KV_TILE + j].
template <typename src_t, int D, int N>
inline void score_rows(const float* q, const src_t* kp, int64_t block_size, float* out) {
  vf acc[N][VPU];
  for (int i = 0; i < N; ++i)
    for (int v = 0; v < VPU; ++v) acc[i][v] = splat(0.0f);
  for (int d = 0; d < D; ++d) {
    vf k[VPU];
    for (int v = 0; v < VPU; ++v) k[v] = load(kp + d * block_size + v * LANES);
    for (int i = 0; i < N; ++i) {
      const vf a = splat(q[i * D + d]);
      for (int v = 0; v < VPU; ++v) acc[i][v] = acc[i][v] + a * k[v];
    }
  }
  for (int i = 0; i < N; ++i)
    for (int v = 0; v < VPU; ++v) store(out + i * KV_TILE + v * LANES, acc[i][v]);
}

// Scores of `rows` rows against one unit of keys at `kp` (dimension stride `ds`): a unit of
// the cache itself or its float32 copy; the same arithmetic either way (bf16 widens exactly).
template <typename src_t, int D>
inline void score_unit(const float* q, int rows, const src_t* kp, int64_t ds, float* out) {
  int r0 = 0;
  for (; r0 + ROW_BLOCK <= rows; r0 += ROW_BLOCK)
    score_rows<src_t, D, ROW_BLOCK>(q + r0 * D, kp, ds, out + r0 * KV_TILE);
  const float* qr = q + r0 * D;
  float* o = out + r0 * KV_TILE;
  switch (rows - r0) {
    case 1: score_rows<src_t, D, 1>(qr, kp, ds, o); break;
    case 2: score_rows<src_t, D, 2>(qr, kp, ds, o); break;
    case 3: score_rows<src_t, D, 3>(qr, kp, ds, o); break;
    case 4: score_rows<src_t, D, 4>(qr, kp, ds, o); break;
    case 5: score_rows<src_t, D, 5>(qr, kp, ds, o); break;
    case 6: score_rows<src_t, D, 6>(qr, kp, ds, o); break;
    case 7: score_rows<src_t, D, 7>(qr, kp, ds, o); break;
    default: break;
  }
}

// o[i, d0:d0+32] += p[i, j] * V[j, d0:d0+32] for the keys j in [j0, j1) of one unit, in key
// order; with `check`, row i only up to its own last visible key.
template <typename src_t, int D, int N, bool check>
inline void pv_rows(const float* p, const int64_t* last, const src_t* vp, int64_t u0,
                    int64_t j0, int64_t j1, int64_t t0, float* acc) {
  for (int d0 = 0; d0 < D; d0 += VPU * LANES) {
    vf o[N][VPU];
    for (int i = 0; i < N; ++i)
      for (int v = 0; v < VPU; ++v) o[i][v] = load(acc + i * D + d0 + v * LANES);
    for (int64_t j = j0; j < j1; ++j) {
      vf x[VPU];
      for (int v = 0; v < VPU; ++v) x[v] = load(vp + (j - u0) * D + d0 + v * LANES);
      for (int i = 0; i < N; ++i) {
        if (!check || j <= last[i]) {
          const vf a = splat(p[i * KV_TILE + (j - t0)]);
          for (int v = 0; v < VPU; ++v) o[i][v] = o[i][v] + a * x[v];
        }
      }
    }
    for (int i = 0; i < N; ++i)
      for (int v = 0; v < VPU; ++v) store(acc + i * D + d0 + v * LANES, o[i][v]);
  }
}

template <typename src_t, int D, int N>
inline void pv_block(const float* p, const int64_t* last, const src_t* vp, int64_t u0,
                     int64_t u_end, int64_t t0, float* acc) {
  int64_t lo = last[0];
  for (int i = 1; i < N; ++i) lo = last[i] < lo ? last[i] : lo;
  const int64_t free_end = lo + 1 < u_end ? (lo + 1 > u0 ? lo + 1 : u0) : u_end;
  if (free_end > u0) pv_rows<src_t, D, N, false>(p, last, vp, u0, u0, free_end, t0, acc);
  if (u_end > free_end) pv_rows<src_t, D, N, true>(p, last, vp, u0, free_end, u_end, t0, acc);
}

// acc[r, :] += sum over the keys [u0, u_end) of one unit (values at `vp`, key u0 first, rows
// of D), in key order, each row up to its own last visible key, of p[r, j] * V[j, :].
template <typename src_t, int D>
inline void pv_unit(const float* p, int rows, const int64_t* last, const src_t* vp, int64_t u0,
                    int64_t u_end, int64_t t0, float* acc) {
  int r0 = 0;
  for (; r0 + ROW_BLOCK <= rows; r0 += ROW_BLOCK)
    pv_block<src_t, D, ROW_BLOCK>(p + r0 * KV_TILE, last + r0, vp, u0, u_end, t0,
                                  acc + r0 * D);
  const float* pr = p + r0 * KV_TILE;
  float* ar = acc + r0 * D;
  switch (rows - r0) {
    case 1: pv_block<src_t, D, 1>(pr, last + r0, vp, u0, u_end, t0, ar); break;
    case 2: pv_block<src_t, D, 2>(pr, last + r0, vp, u0, u_end, t0, ar); break;
    case 3: pv_block<src_t, D, 3>(pr, last + r0, vp, u0, u_end, t0, ar); break;
    case 4: pv_block<src_t, D, 4>(pr, last + r0, vp, u0, u_end, t0, ar); break;
    case 5: pv_block<src_t, D, 5>(pr, last + r0, vp, u0, u_end, t0, ar); break;
    case 6: pv_block<src_t, D, 6>(pr, last + r0, vp, u0, u_end, t0, ar); break;
    case 7: pv_block<src_t, D, 7>(pr, last + r0, vp, u0, u_end, t0, ar); break;
    default: break;
  }
}

template <typename q_t, typename kv_t, int D>
void run(const torch::Tensor& query, const torch::Tensor& key_cache,
         const torch::Tensor& value_cache, torch::Tensor& output,
         const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
         const torch::Tensor& block_table, double scale) {
  const int64_t heads = query.size(1);
  const int64_t kv_heads = key_cache.size(1);
  const int rep = static_cast<int>(heads / kv_heads);
  const int64_t reqs = seq_lens.size(0);
  const auto qsl = query_start_loc.to(torch::kInt64).contiguous();
  const auto sl = seq_lens.to(torch::kInt64).contiguous();
  const int64_t* qs = qsl.data_ptr<int64_t>();
  const int64_t* lens = sl.data_ptr<int64_t>();
  const auto bt = block_table.to(torch::kInt32).contiguous();

  struct Item {
    int64_t req, head, q0, q1;
  };
  std::vector<Item> items;
  for (int64_t r = 0; r < reqs; ++r)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t q0 = qs[r]; q0 < qs[r + 1]; q0 += Q_TILE)
        items.push_back({r, h, q0, std::min<int64_t>(q0 + Q_TILE, qs[r + 1])});

  const q_t* qp = query.data_ptr<q_t>();
  q_t* op = output.data_ptr<q_t>();
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = output.stride(0), o_head = output.stride(1);
  const float fscale = static_cast<float>(scale);

  // the most keys first, taken one by one: causal items differ in work by their position
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return lens[a.req] - (qs[a.req + 1] - a.q1) > lens[b.req] - (qs[b.req + 1] - b.q1);
  });
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int max_rows = Q_TILE * rep;
    std::vector<float> qbuf(max_rows * D), acc(max_rows * D), probs(max_rows * KV_TILE);
    std::vector<float> run_max(max_rows), run_sum(max_rows);
    std::vector<int64_t> last(max_rows);
    std::vector<float> kbuf(KV_TILE * D), vbuf(KV_TILE * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) {
      const Item& it = items[w];
      const int64_t n_q = it.q1 - it.q0;
      const int rows = static_cast<int>(n_q * rep);
      const int64_t seq = lens[it.req];
      const int64_t first_pos = seq - (qs[it.req + 1] - qs[it.req]) + (it.q0 - qs[it.req]);
      Cache<kv_t> c{key_cache.data_ptr<kv_t>(), value_cache.data_ptr<kv_t>(),
                    key_cache.stride(0), key_cache.stride(1), key_cache.size(2),
                    bt.data_ptr<int32_t>() + it.req * bt.stride(0)};
      // rows: token-major, then the KV head's query heads
      for (int64_t t = 0; t < n_q; ++t) {
        for (int g = 0; g < rep; ++g) {
          const int row = static_cast<int>(t * rep + g);
          const q_t* src = qp + (it.q0 + t) * q_tok + (it.head * rep + g) * q_head;
          for (int d = 0; d < D; ++d) qbuf[row * D + d] = to_float(src[d]) * fscale;
          last[row] = first_pos + t;
          run_max[row] = -std::numeric_limits<float>::infinity();
          run_sum[row] = 0.0f;
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * D, 0.0f);
      const int64_t last_key = first_pos + n_q - 1;
      for (int64_t t0 = 0; t0 <= last_key; t0 += KV_TILE) {
        const int64_t t_end = std::min<int64_t>(t0 + KV_TILE, last_key + 1);
        // many rows: widen the tile's keys and values to float32 once for all of them
        const bool widen = rows >= WIDEN_ROWS;
        for (int64_t u0 = t0; u0 < t_end; u0 += KV_UNIT) {
          const kv_t* kp = c.key + c.table[u0 / c.block_size] * c.block_stride +
                           it.head * c.head_stride + u0 % c.block_size;
          float* out = probs.data() + (u0 - t0);
          if (widen) {
            float* kb = kbuf.data() + (u0 - t0) * D;
            for (int d = 0; d < D; ++d)
              for (int v = 0; v < VPU; ++v)
                store(kb + d * KV_UNIT + v * LANES, load(kp + d * c.block_size + v * LANES));
            score_unit<float, D>(qbuf.data(), rows, kb, KV_UNIT, out);
          } else {
            score_unit<kv_t, D>(qbuf.data(), rows, kp, c.block_size, out);
          }
        }
        for (int row = 0; row < rows; ++row) {
          float* s = probs.data() + row * KV_TILE;
          // keys past the row's own position (and past the units scored) are exactly 0; a
          // row before this tile sees none of it (its maximum stays, it adds 0 to the sum)
          const int64_t visible =
              std::max<int64_t>(0, std::min<int64_t>(last[row] + 1, t0 + KV_TILE) - t0);
          for (int64_t j = visible; j < KV_TILE; ++j)
            s[j] = -std::numeric_limits<float>::infinity();
          vf m = load(s);
          for (int k = 1; k < KV_TILE / LANES; ++k) {
            const vf x = load(s + k * LANES);
            m = x > m ? x : m;
          }
          const float tile_max = hmax(m);
          const float new_max = tile_max > run_max[row] ? tile_max : run_max[row];
          vf sum = splat(0.0f);
          for (int k = 0; k < KV_TILE / LANES; ++k) {
            const vf e = vexp(load(s + k * LANES) - splat(new_max));
            store(s + k * LANES, e);
            sum = sum + e;
          }
          if (new_max != run_max[row]) {  // else the factor is exp(0) = 1: nothing to scale
            const float alpha = vexp(splat(run_max[row] - new_max))[0];
            run_sum[row] = run_sum[row] * alpha;
            float* a = acc.data() + row * D;
            for (int d = 0; d < D; d += LANES) store(a + d, load(a + d) * splat(alpha));
          }
          run_sum[row] = run_sum[row] + hsum(sum);
          run_max[row] = new_max;
        }
        for (int64_t u0 = t0; u0 < t_end; u0 += KV_UNIT) {
          const kv_t* vp = c.value + c.table[u0 / c.block_size] * c.block_stride +
                           it.head * c.head_stride + (u0 % c.block_size) * D;
          const int64_t u_end = std::min<int64_t>(u0 + KV_UNIT, t_end);
          if (widen) {
            float* vb = vbuf.data() + (u0 - t0) * D;
            for (int64_t j = 0; j < (u_end - u0) * D; j += LANES) store(vb + j, load(vp + j));
            pv_unit<float, D>(probs.data(), rows, last.data(), vb, u0, u_end, t0, acc.data());
          } else {
            pv_unit<kv_t, D>(probs.data(), rows, last.data(), vp, u0, u_end, t0, acc.data());
          }
        }
      }
      for (int64_t t = 0; t < n_q; ++t) {
        for (int g = 0; g < rep; ++g) {
          const int row = static_cast<int>(t * rep + g);
          q_t* dst = op + (it.q0 + t) * o_tok + (it.head * rep + g) * o_head;
          const float inv = 1.0f / run_sum[row];
          for (int d = 0; d < D; ++d) dst[d] = static_cast<q_t>(acc[row * D + d] * inv);
        }
      }
    }
  }
}

template <typename q_t, typename kv_t>
void dispatch_dim(int64_t d, const torch::Tensor& q, const torch::Tensor& k,
                  const torch::Tensor& v, torch::Tensor& o, const torch::Tensor& qsl,
                  const torch::Tensor& sl, const torch::Tensor& bt, double scale) {
  switch (d) {
    case 64: return run<q_t, kv_t, 64>(q, k, v, o, qsl, sl, bt, scale);
    case 128: return run<q_t, kv_t, 128>(q, k, v, o, qsl, sl, bt, scale);
    case 256: return run<q_t, kv_t, 256>(q, k, v, o, qsl, sl, bt, scale);
    default: TORCH_CHECK(false, "split-invariant attention: head_dim ", d,
                         " not supported (64, 128, 256)");
  }
}

}  // namespace

void split_invariant_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                               const torch::Tensor& value_cache, torch::Tensor& output,
                               const torch::Tensor& query_start_loc,
                               const torch::Tensor& seq_lens, const torch::Tensor& block_table,
                               double scale) {
  TORCH_CHECK(query.dim() == 3 && output.sizes() == query.sizes(), "query/output [T, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key/value cache [blocks, kv_heads, block_size, D]");
  TORCH_CHECK(query.stride(2) == 1 && output.stride(2) == 1, "query/output rows contiguous");
  TORCH_CHECK(key_cache.size(2) % KV_UNIT == 0, "block size must be a multiple of 32");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads per KV head");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(seq_lens.size(0) + 1 == query_start_loc.size(0), "one seq_len per request");
  const int64_t d = query.size(2);
  TORCH_CHECK(key_cache.size(3) == d, "head_dim of query and cache differ");
  if (query.scalar_type() == at::kBFloat16) {
    dispatch_dim<at::BFloat16, at::BFloat16>(d, query, key_cache, value_cache, output,
                                             query_start_loc, seq_lens, block_table, scale);
  } else if (query.scalar_type() == at::kFloat) {
    dispatch_dim<float, float>(d, query, key_cache, value_cache, output, query_start_loc,
                               seq_lens, block_table, scale);
  } else {
    TORCH_CHECK(false, "split-invariant attention: bf16 or float32 only");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("split_invariant_attention", &split_invariant_attention,
        "paged causal attention whose per-query arithmetic does not depend on the step");
}
