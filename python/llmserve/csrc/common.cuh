// Shared device helpers for llmserve's CUDA ops: 16-byte vectors of fp16/bf16 <-> fp32, warp
// reductions. The host side's dispatch macros are in dispatch.h.
//
// Invariants every kernel here relies on (checked on the host side, see check_* in each .cu):
// a "vector" is 16 bytes = 8 fp16/bf16 elements, rows of head_dim elements start 16-byte
// aligned, and head_dim is 64 or 128.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace llmserve {

constexpr int kVecElems = 8;   // elements of fp16/bf16 in one 16-byte load
constexpr int kWarpSize = 32;

// 8 elements of T (packed in a uint4) -> 8 floats.
template <typename T>
__device__ __forceinline__ void vec_to_float(const uint4& v, float (&out)[kVecElems]);

template <>
__device__ __forceinline__ void vec_to_float<__half>(const uint4& v, float (&out)[kVecElems]) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void vec_to_float<__nv_bfloat16>(const uint4& v, float (&out)[kVecElems]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// 8 floats -> 8 elements of T packed in a uint4 (one 16-byte store).
template <typename T>
__device__ __forceinline__ uint4 float_to_vec(const float (&in)[kVecElems]) {
  uint4 v;
  T* h = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) h[i] = from_float<T>(in[i]);
  return v;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace llmserve
