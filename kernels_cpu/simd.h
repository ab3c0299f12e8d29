// The vector helpers both CPU kernels use: one native vector type per build, loads and stores,
// a broadcast, and bfloat16 <-> float32. Shared so the kernels cannot drift apart (the build key
// in kernels_cpu/__init__.py hashes this header with each source).
//
// The native vector of the build (-march=native): 512 bits with AVX-512, 256 with AVX/AVX2,
// 128 otherwise (SSE, NEON). Register blocks are sized by the register file, 32 vector registers
// on AVX-512 and AArch64 and 16 on AVX2 and SSE: a block that does not fit spills every
// accumulator to the stack each iteration (16-float vectors emulated on AVX2 ran attention's
// decode at a tenth of the memory bandwidth and its prefill at 4 GFLOP/s that way).

#ifndef JAXRUNNER_KERNELS_CPU_SIMD_H_
#define JAXRUNNER_KERNELS_CPU_SIMD_H_

#include <cstdint>
#include <cstring>

namespace jaxrunner_simd {

#if defined(__AVX512F__)
#define JR_LANES 16
constexpr int kVecRegs = 32;
#elif defined(__AVX__)
#define JR_LANES 8
constexpr int kVecRegs = 16;
#elif defined(__aarch64__)
#define JR_LANES 4
constexpr int kVecRegs = 32;
#else
#define JR_LANES 4
constexpr int kVecRegs = 16;
#endif
constexpr int kLanes = JR_LANES;  // floats per vector

// Hot helpers must inline: a vector argument of a non-inlined call goes through memory.
#define JR_INLINE inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
// An unaligned view for loads and stores from plain float arrays.
typedef float vf_u __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

JR_INLINE vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
JR_INLINE void store(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
// x - 0 is x for every x (x + 0 is not, for x = -0), so the compiler folds it to a broadcast.
JR_INLINE vf splat(float x) { return x - vf{}; }

struct BF16 {
  uint16_t bits;
};

// kLanes bfloat16 widened to float32 (zero-extend, shift into the high half).
JR_INLINE vf load(const BF16* p) {
  typedef uint16_t vh_u __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2)));
  typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  const vu u = __builtin_convertvector(*reinterpret_cast<const vh_u*>(p), vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

JR_INLINE float to_f32(float x) { return x; }
JR_INLINE float to_f32(BF16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as XLA converts; NaN stays NaN.
JR_INLINE BF16 to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return BF16{uint16_t(u >> 16)};
}

}  // namespace jaxrunner_simd

#endif  // JAXRUNNER_KERNELS_CPU_SIMD_H_
