// Vector types and loads of the host-built CPU kernels (split_attention_cpu.cpp,
// rowwise_linear_cpu.cpp), compiled with -march=native.
//
// The vector type matches the host's registers: 16 float lanes with AVX-512, 8 otherwise.
// Wider generic vectors than the hardware's are expanded piecewise by the compiler, over ten
// times slower on an AVX2 host. The lane count fixes the order of a kernel's sums (a property
// of the build, as vLLM's own kernels are of the host's ISA, which the engine fingerprint
// names); within one build every row's arithmetic is its own.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace hc_cpu {

#if defined(__AVX512F__)
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 -> float32 is exact: the bf16 bits are the float's upper half.
inline vf load(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

}  // namespace hc_cpu
