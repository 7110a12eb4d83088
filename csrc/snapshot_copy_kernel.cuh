// GPU kernels of the snapshot copy: one workgroup per tile of the segment table, all rows of
// one link in one launch. Compiled by clang-19 into gfx1151/gfx1201 code objects (the CI check)
// and by hipcc/nvcc into the torch GPU extension (snapshot_copy_device.cu).
//
// Thread and workgroup ids come from the amdgcn builtins on AMD targets: they lower to the
// hardware registers directly, whereas ROCm 5.x headers route threadIdx/blockIdx through device
// libraries that have no gfx1151/gfx1201 builds.
#pragma once

#include "snapshot_copy.h"

#if defined(__AMDGCN__) || defined(__HIP__)
#define HC_THREAD() static_cast<int64_t>(__builtin_amdgcn_workitem_id_x())
#define HC_BLOCK() static_cast<int64_t>(__builtin_amdgcn_workgroup_id_x())
#else
#define HC_THREAD() static_cast<int64_t>(threadIdx.x)
#define HC_BLOCK() static_cast<int64_t>(blockIdx.x)
#endif

#if !defined(__launch_bounds__)
#define __launch_bounds__(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
#endif

// Threads per workgroup: 256 = 8 wave32 waves on RDNA, 4 wave64 waves on CDNA, 8 warps on NVIDIA.
#define HC_THREADS 256

namespace hybridcache {

template <typename W>
__device__ inline void copy_tile_device(const int64_t* table, int64_t rows, int64_t tile_words) {
  const int64_t tile = HC_BLOCK();
  const int64_t row = find_segment(table, rows, tile);
  copy_tile<W>(table, row, tile, tile_words, HC_THREAD(), HC_THREADS);
}

}  // namespace hybridcache

// One kernel per word width; the host picks the widest width that divides every address and
// length of the table. extern "C" keeps the symbol names readable in the code object.
#define HC_DEFINE_COPY_KERNEL(NAME, W)                                                       \
  extern "C" __global__ void __launch_bounds__(HC_THREADS)                                   \
      NAME(const int64_t* table, int64_t rows, int64_t tile_words) {                          \
    hybridcache::copy_tile_device<W>(table, rows, tile_words);                               \
  }

HC_DEFINE_COPY_KERNEL(hc_snapshot_copy_w16, hybridcache::Word16)
HC_DEFINE_COPY_KERNEL(hc_snapshot_copy_w8, uint64_t)
HC_DEFINE_COPY_KERNEL(hc_snapshot_copy_w4, uint32_t)
HC_DEFINE_COPY_KERNEL(hc_snapshot_copy_w1, uint8_t)
