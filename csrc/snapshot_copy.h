// Element logic of the snapshot copy, shared by every build of it.
//
// A snapshot link is scattered over device memory: one or two pieces per KV block per attention
// layer, plus one recurrent-state slot per state tensor. Copying it one memcpy per piece costs a
// launch (or, on ROCm, a DMA-engine job) per piece; this copies a whole *segment table* in one
// launch instead. A segment is (source address, destination address, length in words); the
// table also holds each segment's first tile, so a launch of `total tiles` workgroups needs no
// other state. Gather (cache -> contiguous link buffer) and scatter (buffer -> cache) are the
// same operation with the address columns swapped, which the host side decides.
//
// The same functions compile four ways: g++ for the CPU twin (a torch C++ extension), clang
// `-x hip` for gfx1151/gfx1201 code objects, hipcc/nvcc for the torch GPU extension. Nothing
// here touches a runtime API, so the CPU twin and the GPU kernels execute identical arithmetic.
#pragma once

#include <stdint.h>

#if defined(__HIP__) || defined(__CUDACC__)
// Without the HIP runtime headers (the code-object build uses -nogpuinc) the attributes have
// their clang spellings.
#if !defined(__host__)
#define __host__ __attribute__((host))
#endif
#if !defined(__device__)
#define __device__ __attribute__((device))
#endif
#if !defined(__global__)
#define __global__ __attribute__((global))
#endif
#define HC_HD __host__ __device__
#else
#define HC_HD
#endif

namespace hybridcache {

// Columns of one row of the segment table (int64 [n, HC_COLS]).
enum : int { HC_SRC = 0, HC_DST = 1, HC_WORDS = 2, HC_FIRST_TILE = 3, HC_COLS = 4 };

// A 16-byte word: the widest load/store every target has (dwordx4 on AMD, 128-bit on NVIDIA,
// one SSE/AVX move on the CPU).
struct alignas(16) Word16 {
  uint32_t v[4];
};

// Tiles a segment of `words` words is cut into (at least one for an empty segment, so that
// every row owns a tile and first_tile is strictly increasing).
HC_HD inline int64_t tiles_for(int64_t words, int64_t tile_words) {
  int64_t t = (words + tile_words - 1) / tile_words;
  return t > 0 ? t : 1;
}

// The row whose tiles contain `tile`: the last row with first_tile <= tile (binary search;
// rows are ordered by first_tile).
HC_HD inline int64_t find_segment(const int64_t* table, int64_t rows, int64_t tile) {
  int64_t lo = 0, hi = rows - 1;
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) / 2;
    if (table[mid * HC_COLS + HC_FIRST_TILE] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Copy words [begin, end) of one tile of the segment in `row`, a worker taking every `step`-th
// word starting at `lane` (GPU: lane = thread, step = threads; CPU: lane 0, step 1).
template <typename W>
HC_HD inline void copy_tile(const int64_t* table, int64_t row, int64_t tile, int64_t tile_words,
                            int64_t lane, int64_t step) {
  const int64_t* r = table + row * HC_COLS;
  const W* src = reinterpret_cast<const W*>(static_cast<uintptr_t>(r[HC_SRC]));
  W* dst = reinterpret_cast<W*>(static_cast<uintptr_t>(r[HC_DST]));
  const int64_t words = r[HC_WORDS];
  const int64_t begin = (tile - r[HC_FIRST_TILE]) * tile_words;
  int64_t end = begin + tile_words;
  if (end > words) end = words;
#if !defined(__HIP_DEVICE_COMPILE__) && !defined(__CUDA_ARCH__)
  // Host: a worker owns the whole tile, and libc's memcpy moves it at full bandwidth (the word
  // loop below is the same copy; g++ does not always turn it into one).
  if (step == 1 && lane == 0) {
    if (end > begin) __builtin_memcpy(dst + begin, src + begin, (end - begin) * sizeof(W));
    return;
  }
#endif
  for (int64_t i = begin + lane; i < end; i += step) dst[i] = src[i];
}

}  // namespace hybridcache
