// CPU twin of the snapshot copy kernel: the same segment table and the same element logic
// (snapshot_copy.h), executed by ATen's thread pool instead of GPU workgroups. It is what CI
// can run bit for bit against torch index ops, and it replaces one torch copy_ per KV block with
// one call per link on the CPU backend.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "snapshot_copy.h"

namespace {

using hybridcache::HC_COLS;
using hybridcache::HC_FIRST_TILE;

template <typename W>
void run_table(const int64_t* table, int64_t rows, int64_t tiles, int64_t tile_words) {
  // One task per range of tiles; within a range the row only moves forward, so the binary
  // search runs once per range.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    int64_t row = hybridcache::find_segment(table, rows, begin);
    for (int64_t t = begin; t < end; ++t) {
      while (row + 1 < rows && table[(row + 1) * HC_COLS + HC_FIRST_TILE] <= t) ++row;
      hybridcache::copy_tile<W>(table, row, t, tile_words, 0, 1);
    }
  });
}

// Execute a segment table (int64 [rows, 4], CPU, contiguous) whose addresses are CPU memory.
void snapshot_copy(const torch::Tensor& table, int64_t tiles, int64_t tile_words,
                   int64_t word_bytes) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == torch::kInt64 &&
                  table.dim() == 2 && table.size(1) == HC_COLS && table.is_contiguous(),
              "segment table must be a contiguous CPU int64 tensor [rows, 4]");
  TORCH_CHECK(tile_words > 0, "tile_words must be positive");
  const int64_t rows = table.size(0);
  if (rows == 0) return;
  const int64_t* t = table.data_ptr<int64_t>();
  switch (word_bytes) {
    case 16: run_table<hybridcache::Word16>(t, rows, tiles, tile_words); break;
    case 8: run_table<uint64_t>(t, rows, tiles, tile_words); break;
    case 4: run_table<uint32_t>(t, rows, tiles, tile_words); break;
    case 1: run_table<uint8_t>(t, rows, tiles, tile_words); break;
    default: TORCH_CHECK(false, "word_bytes must be 16, 8, 4 or 1, got ", word_bytes);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("snapshot_copy", &snapshot_copy,
        "Copy every segment of a table (src, dst, words, first_tile) on the CPU");
}
