// Translation unit for the AMD code objects that CI checks without a GPU (clang-19,
// `-x hip --cuda-device-only -nogpulib -nogpuinc --offload-arch=gfx1151|gfx1201`): the same
// kernels the torch GPU extension launches, nothing else.
#include "snapshot_copy_kernel.cuh"
