// Host-side dispatch for llmserve's CUDA ops: bind a tensor's dtype and head size to the kernel
// instantiations we serve (fp16/bf16, head_dim 64/128), or fail with a clear TORCH_CHECK.
// Host code only (g++ or nvcc): it needs the CUDA half types, not device code.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Dispatch on the cache dtype: binds `scalar_t` to __half or __nv_bfloat16.
#define LLMSERVE_DISPATCH_HALF_TYPES(DTYPE, NAME, ...)                                        \
  [&] {                                                                                        \
    if ((DTYPE) == c10::ScalarType::Half) {                                                     \
      using scalar_t = __half;                                                                 \
      return __VA_ARGS__();                                                                    \
    } else if ((DTYPE) == c10::ScalarType::BFloat16) {                                          \
      using scalar_t = __nv_bfloat16;                                                          \
      return __VA_ARGS__();                                                                    \
    }                                                                                          \
    TORCH_CHECK(false, NAME, ": dtype ", DTYPE, " is not supported (float16 or bfloat16 only)"); \
  }()

// Dispatch on head_dim: binds `kHeadDim` to 64 or 128, the only sizes instantiated.
#define LLMSERVE_DISPATCH_HEAD_DIM(HEAD_DIM, NAME, ...)                                   \
  [&] {                                                                                   \
    if ((HEAD_DIM) == 64) {                                                               \
      constexpr int kHeadDim = 64;                                                        \
      return __VA_ARGS__();                                                               \
    } else if ((HEAD_DIM) == 128) {                                                       \
      constexpr int kHeadDim = 128;                                                       \
      return __VA_ARGS__();                                                               \
    }                                                                                     \
    TORCH_CHECK(false, NAME, ": head_dim ", HEAD_DIM, " is not supported (64 or 128 only)"); \
  }()
