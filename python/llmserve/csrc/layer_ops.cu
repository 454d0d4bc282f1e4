// llmserve's fused decoder-layer ops: RMSNorm (alone, or with the residual add before it), the
// SwiGLU product and RoPE in place. A small-batch decode step is bound by kernel launches: torch
// runs RMSNorm in bf16 as 4-8 kernels, the residual add as one more, RoPE as seven and
// silu(gate) * up as two. Each op here is one kernel.
//
// Every op rounds where the eager torch code it replaces rounds (models/layers.py), so a model
// gives the same tokens with or without them:
//   rms_norm:        y = T(T(x * r) * w)   for a weight of the input's dtype T (Llama's),
//                    y = T(x * r * w)      for a float32 weight (Gemma's 1 + w),
//                    with r = rsqrt(mean(x^2) + eps) over the row, in float32.
//   fused_add_rms_norm: residual = T(residual + input), then input = rms_norm(residual).
//   silu_and_mul:    out = T(T(silu(gate)) * up) of input rows [gate | up].
//   rotary_embedding: (x1, x2) -> (T(T(x1 c) - T(x2 s)), T(T(x2 c) + T(x1 s))) for the pairs
//                    (i, i + d/2) of HF's rotate-half layout, cos/sin already of dtype T.
//
// Only fp16/bf16 with rows of 16-byte vectors are served; the Python side (kernels.fused_unserved)
// keeps everything else on the torch path, and the checks below reject it clearly.
#include <ATen/DeviceGuard.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "dispatch.h"

namespace llmserve {
namespace {

constexpr int kMaxThreads = 1024;

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float<T>(from_float<T>(x));
}

// 8 consecutive elements of T (a uint4) or of float (two float4s) -> floats.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&out)[kVecElems]) {
  vec_to_float<T>(*reinterpret_cast<const uint4*>(p), out);
}

template <>
__device__ __forceinline__ void load8<float>(const float* p, float (&out)[kVecElems]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

// The sum of x over the CTA, returned to every thread (blockDim.x a multiple of 32).
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float s_warps[kMaxThreads / kWarpSize];
  __shared__ float s_total;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  x = warp_sum(x);
  if (lane == 0) s_warps[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < (int)(blockDim.x / kWarpSize) ? s_warps[lane] : 0.f;
    x = warp_sum(x);
    if (lane == 0) s_total = x;
  }
  __syncthreads();
  return s_total;
}

// One CTA per row; each thread walks the row's 16-byte vectors. With kAdd the row is first
// residual = T(residual + input), written back, and normalized from there into `input`.
// grid: (rows); block: a multiple of 32, at most kMaxThreads.
template <typename T, typename W, bool kAdd>
// (no __restrict__ on out and input: fused_add_rms_norm writes the input rows it read)
__global__ void rms_norm_kernel(T* out, const T* input, T* __restrict__ residual,
                                const W* __restrict__ weight, int64_t out_stride, int64_t input_stride,
                                int64_t residual_stride, int vecs /* hidden / 8 */, float eps) {
  const int64_t row = blockIdx.x;
  const T* x_row = input + row * input_stride;
  T* res_row = kAdd ? residual + row * residual_stride : nullptr;
  float sq = 0.f;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float x[kVecElems];
    load8<T>(x_row + v * kVecElems, x);
    if constexpr (kAdd) {
      float r[kVecElems];
      load8<T>(res_row + v * kVecElems, r);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) x[j] = round_to<T>(r[j] + x[j]);
      reinterpret_cast<uint4*>(res_row)[v] = float_to_vec<T>(x);
    }
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sq = fmaf(x[j], x[j], sq);
  }
  const float r = rsqrtf(block_sum(sq) / (float)(vecs * kVecElems) + eps);
  // Second pass: the row again (this thread's own vectors, mostly from L1), scaled.
  const T* src = kAdd ? res_row : x_row;
  T* out_row = out + row * out_stride;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float x[kVecElems], w[kVecElems], y[kVecElems];
    load8<T>(src + v * kVecElems, x);
    load8<W>(weight + v * kVecElems, w);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      if constexpr (std::is_same_v<W, float>) {
        y[j] = x[j] * r * w[j];
      } else {
        y[j] = round_to<T>(x[j] * r) * w[j];
      }
    }
    reinterpret_cast<uint4*>(out_row)[v] = float_to_vec<T>(y);
  }
}

// out [T, I] = T(T(silu(gate)) * up) of input [T, 2I] = [gate | up].
// grid: (tokens, ceil(I / 8 / blockDim)); block: 128.
template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ input, int64_t out_stride,
                                    int64_t input_stride, int vecs /* I / 8 */) {
  const int64_t row = blockIdx.x;
  const int v = blockIdx.y * blockDim.x + threadIdx.x;
  if (v >= vecs) return;
  const T* in_row = input + row * input_stride;
  float g[kVecElems], u[kVecElems], y[kVecElems];
  load8<T>(in_row + v * kVecElems, g);
  load8<T>(in_row + (int64_t)vecs * kVecElems + v * kVecElems, u);
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) y[j] = round_to<T>(g[j] / (1.f + __expf(-g[j]))) * u[j];
  reinterpret_cast<uint4*>(out + row * out_stride)[v] = float_to_vec<T>(y);
}

// In place on the first `heads` heads of each row of x [T, >= heads * D]: rotate-half RoPE with
// cos/sin [T, D/2] (rows contiguous). Each thread takes 8 consecutive pairs of one head.
// grid: (tokens); block: 128 threads striding over heads * D / 16 pieces.
template <typename T>
__global__ void rotary_embedding_kernel(T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                                        int64_t x_stride, int64_t cs_stride, int heads, int head_dim) {
  const int64_t row = blockIdx.x;
  const int half = head_dim / 2, pieces = half / kVecElems;
  T* x_row = x + row * x_stride;
  const T* c_row = cos + row * cs_stride;
  const T* s_row = sin + row * cs_stride;
  for (int i = threadIdx.x; i < heads * pieces; i += blockDim.x) {
    const int head = i / pieces, off = (i % pieces) * kVecElems;
    T* lo = x_row + (int64_t)head * head_dim + off;
    T* hi = lo + half;
    float x1[kVecElems], x2[kVecElems], c[kVecElems], s[kVecElems], o1[kVecElems], o2[kVecElems];
    load8<T>(lo, x1);
    load8<T>(hi, x2);
    load8<T>(c_row + off, c);
    load8<T>(s_row + off, s);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      o1[j] = round_to<T>(x1[j] * c[j]) - round_to<T>(x2[j] * s[j]);
      o2[j] = round_to<T>(x2[j] * c[j]) + round_to<T>(x1[j] * s[j]);
    }
    *reinterpret_cast<uint4*>(lo) = float_to_vec<T>(o1);
    *reinterpret_cast<uint4*>(hi) = float_to_vec<T>(o2);
  }
}

bool aligned16(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// A [rows, width] tensor of 16-byte vectors: 2-D, each row contiguous and 16-byte aligned.
void check_rows(const char* name, const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), name, ": ", what, " must be on a CUDA device");
  TORCH_CHECK(t.dim() == 2, name, ": ", what, " must be 2-D [tokens, width], got ", t.dim(), "-D");
  TORCH_CHECK(t.stride(1) == 1, name, ": ", what, "'s rows must be contiguous");
  TORCH_CHECK(t.size(1) % kVecElems == 0, name, ": ", what, "'s width ", t.size(1), " is not a multiple of ",
              kVecElems);
  TORCH_CHECK(aligned16(t) && (t.stride(0) * t.element_size()) % 16 == 0, name, ": ", what,
              "'s rows must start 16-byte aligned");
}

void check_half(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, name, ": dtype ",
              t.scalar_type(), " is not supported (float16 or bfloat16 only)");
}

int norm_threads(int vecs) {
  const int warps = (vecs + kWarpSize - 1) / kWarpSize;
  return std::min(kMaxThreads, std::max(1, warps) * kWarpSize);
}

template <bool kAdd>
void launch_rms_norm(const char* name, at::Tensor& out, const at::Tensor& input, at::Tensor* residual,
                     const at::Tensor& weight, double eps) {
  check_rows(name, "input", input);
  check_rows(name, "out", out);
  check_half(name, input);
  TORCH_CHECK(out.sizes() == input.sizes() && out.scalar_type() == input.scalar_type(), name,
              ": out must be shaped and typed like input");
  if (kAdd) {
    check_rows(name, "residual", *residual);
    TORCH_CHECK(residual->sizes() == input.sizes() && residual->scalar_type() == input.scalar_type(), name,
                ": residual must be shaped and typed like input");
  }
  const int64_t hidden = input.size(1);
  TORCH_CHECK(weight.is_cuda() && weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(), name,
              ": weight must be a contiguous [", hidden, "] on the input's device");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type() || weight.scalar_type() == at::kFloat, name,
              ": weight must be of the input's dtype or float32, got ", weight.scalar_type());
  TORCH_CHECK(aligned16(weight), name, ": weight must be 16-byte aligned");
  const int64_t rows = input.size(0);
  if (rows == 0) return;
  const at::cuda::OptionalCUDAGuard guard(device_of(input));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int vecs = static_cast<int>(hidden / kVecElems);
  const bool fp32_weight = weight.scalar_type() == at::kFloat;
  LLMSERVE_DISPATCH_HALF_TYPES(input.scalar_type(), name, [&] {
    auto* o = reinterpret_cast<scalar_t*>(out.data_ptr());
    const auto* x = reinterpret_cast<const scalar_t*>(input.data_ptr());
    auto* r = kAdd ? reinterpret_cast<scalar_t*>(residual->data_ptr()) : nullptr;
    const int64_t r_stride = kAdd ? residual->stride(0) : 0;
    if (fp32_weight) {
      rms_norm_kernel<scalar_t, float, kAdd><<<rows, norm_threads(vecs), 0, stream>>>(
          o, x, r, weight.data_ptr<float>(), out.stride(0), input.stride(0), r_stride, vecs, (float)eps);
    } else {
      rms_norm_kernel<scalar_t, scalar_t, kAdd><<<rows, norm_threads(vecs), 0, stream>>>(
          o, x, r, reinterpret_cast<const scalar_t*>(weight.data_ptr()), out.stride(0), input.stride(0), r_stride,
          vecs, (float)eps);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// out [T, H] = rms_norm(input [T, H]) * weight [H] (weight of input's dtype or float32).
void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  launch_rms_norm<false>("rms_norm", out, input, nullptr, weight, eps);
}

// residual [T, H] = residual + input; input [T, H] = rms_norm(residual) * weight. Both in place.
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  launch_rms_norm<true>("fused_add_rms_norm", input, input, &residual, weight, eps);
}

// out [T, I] = silu(input[:, :I]) * input[:, I:] for input [T, 2I].
void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  const char* name = "silu_and_mul";
  check_rows(name, "input", input);
  check_rows(name, "out", out);
  check_half(name, input);
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), name, ": out and input must share one dtype");
  TORCH_CHECK(out.size(0) == input.size(0) && input.size(1) == 2 * out.size(1), name,
              ": input must be [T, 2I] for out [T, I], got ", input.sizes(), " and ", out.sizes());
  const int64_t rows = input.size(0);
  if (rows == 0) return;
  const at::cuda::OptionalCUDAGuard guard(device_of(input));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int vecs = static_cast<int>(out.size(1) / kVecElems);
  constexpr int kBlock = 128;
  const dim3 grid(rows, (vecs + kBlock - 1) / kBlock);
  LLMSERVE_DISPATCH_HALF_TYPES(input.scalar_type(), name, [&] {
    silu_and_mul_kernel<scalar_t><<<grid, kBlock, 0, stream>>>(
        reinterpret_cast<scalar_t*>(out.data_ptr()), reinterpret_cast<const scalar_t*>(input.data_ptr()),
        out.stride(0), input.stride(0), vecs);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// x [T, W]: RoPE in place on its first `heads` heads of head_dim D (heads * D <= W); cos/sin
// [T, D/2] of x's dtype.
void rotary_embedding(at::Tensor& x, int64_t heads, const at::Tensor& cos, const at::Tensor& sin) {
  const char* name = "rotary_embedding";
  check_rows(name, "x", x);
  check_half(name, x);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0), name,
              ": cos and sin must both be [T, head_dim / 2] for x's T rows");
  TORCH_CHECK(cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0), name,
              ": cos and sin rows must be contiguous, with one stride");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), name,
              ": cos and sin must be of x's dtype");
  const int64_t head_dim = 2 * cos.size(1);
  TORCH_CHECK(head_dim % (2 * kVecElems) == 0, name, ": head_dim ", head_dim, " is not a multiple of ",
              2 * kVecElems);
  TORCH_CHECK(heads > 0 && heads * head_dim <= x.size(1), name, ": ", heads, " heads of ", head_dim,
              " do not fit in rows of ", x.size(1));
  TORCH_CHECK(aligned16(cos) && aligned16(sin) && (cos.stride(0) * cos.element_size()) % 16 == 0, name,
              ": cos and sin rows must start 16-byte aligned");
  const int64_t rows = x.size(0);
  if (rows == 0) return;
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LLMSERVE_DISPATCH_HALF_TYPES(x.scalar_type(), name, [&] {
    rotary_embedding_kernel<scalar_t><<<rows, 128, 0, stream>>>(
        reinterpret_cast<scalar_t*>(x.data_ptr()), reinterpret_cast<const scalar_t*>(cos.data_ptr()),
        reinterpret_cast<const scalar_t*>(sin.data_ptr()), x.stride(0), cos.stride(0), static_cast<int>(heads),
        static_cast<int>(head_dim));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace llmserve
