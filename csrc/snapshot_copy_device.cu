// Torch GPU extension of the snapshot copy: launches the kernels of snapshot_copy_kernel.cuh
// on the current stream, one launch per segment table (one link). Built with a ROCm torch
// (hipified by torch.utils.cpp_extension, compiled by hipcc for PYTORCH_ROCM_ARCH) in the image,
// or with a CUDA torch by nvcc. The table travels to the device in the same stream, so the copy
// is ordered after the forward that wrote the KV blocks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "snapshot_copy_kernel.cuh"

namespace {

// Execute a segment table (int64 [rows, 4]); addresses must be device memory or pinned host
// memory mapped into the device's address space.
void snapshot_copy(const torch::Tensor& table, int64_t tiles, int64_t tile_words,
                   int64_t word_bytes, int64_t device_index) {
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.dim() == 2 &&
                  table.size(1) == hybridcache::HC_COLS && table.is_contiguous(),
              "segment table must be a contiguous int64 tensor [rows, 4]");
  const int64_t rows = table.size(0);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  const torch::Tensor dev = table.to(torch::Device(torch::kCUDA, device_index), true);
  const int64_t* t = dev.data_ptr<int64_t>();
  const dim3 grid(static_cast<unsigned int>(tiles));
  const dim3 block(HC_THREADS);
  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream();
  cudaStream_t stream = cur.stream();
  switch (word_bytes) {
    case 16: hc_snapshot_copy_w16<<<grid, block, 0, stream>>>(t, rows, tile_words); break;
    case 8: hc_snapshot_copy_w8<<<grid, block, 0, stream>>>(t, rows, tile_words); break;
    case 4: hc_snapshot_copy_w4<<<grid, block, 0, stream>>>(t, rows, tile_words); break;
    case 1: hc_snapshot_copy_w1<<<grid, block, 0, stream>>>(t, rows, tile_words); break;
    default: TORCH_CHECK(false, "word_bytes must be 16, 8, 4 or 1, got ", word_bytes);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Keep the device copy of the table alive until the kernel has read it.
  dev.record_stream(cur.unwrap());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("snapshot_copy", &snapshot_copy,
        "Copy every segment of a table (src, dst, words, first_tile) in one GPU launch");
}
