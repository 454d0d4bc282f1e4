// llmserve::write_kv_cache: scatter this step's K/V rows into the paged cache by slot mapping.
//
// Cache layout (the CPU path's, python/llmserve/worker/kv_cache.py): per layer one K and one V
// tensor [num_blocks, block_size, num_kv_heads, head_dim], contiguous, so token slot
// s = block * block_size + offset owns the num_kv_heads * head_dim elements starting at
// s * num_kv_heads * head_dim. A negative slot means "padding token, write nothing": CUDA-graph
// batches are padded with such rows.
#include <ATen/DeviceGuard.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.cuh"
#include "dispatch.h"

namespace llmserve {
namespace {

// grid: (num_tokens), block: 128 threads striding over the token's 16-byte vectors.
template <typename scalar_t>
__global__ void write_kv_cache_kernel(
    const scalar_t* __restrict__ key,        // [T, kv_heads, head_dim], row stride key_stride
    const scalar_t* __restrict__ value,      // [T, kv_heads, head_dim], row stride value_stride
    scalar_t* __restrict__ key_cache,        // [num_slots, kv_heads, head_dim]
    scalar_t* __restrict__ value_cache,      // [num_slots, kv_heads, head_dim]
    const int64_t* __restrict__ slot_mapping,  // [T]
    int64_t key_stride, int64_t value_stride, int row_vecs /* kv_heads * head_dim / 8 */) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const uint4* k_src = reinterpret_cast<const uint4*>(key + token * key_stride);
  const uint4* v_src = reinterpret_cast<const uint4*>(value + token * value_stride);
  uint4* k_dst = reinterpret_cast<uint4*>(key_cache) + slot * row_vecs;
  uint4* v_dst = reinterpret_cast<uint4*>(value_cache) + slot * row_vecs;
  for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

// key/value [T, kv_heads, head_dim] (rows may be strided, e.g. views of a fused QKV output;
// each row itself contiguous); key_cache/value_cache [num_blocks, block_size, kv_heads,
// head_dim]; slot_mapping [T] int64, -1 = skip.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.is_cuda() && value.is_cuda() && key_cache.is_cuda() && value_cache.is_cuda() &&
                  slot_mapping.is_cuda(),
              "write_kv_cache: every tensor must be on a CUDA device");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "write_kv_cache: key/value must be [T, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4,
              "write_kv_cache: caches must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "write_kv_cache: K and V caches differ in shape");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "write_kv_cache: caches must be contiguous");
  TORCH_CHECK(key.sizes() == value.sizes(), "write_kv_cache: key and value differ in shape");
  const int64_t num_tokens = key.size(0);
  const int64_t kv_heads = key.size(1), head_dim = key.size(2);
  TORCH_CHECK(key_cache.size(2) == kv_heads && key_cache.size(3) == head_dim,
              "write_kv_cache: key is [T, ", kv_heads, ", ", head_dim, "] but the cache holds ",
              key_cache.size(2), " heads of ", key_cache.size(3));
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "write_kv_cache: head_dim ", head_dim,
              " is not supported (64 or 128 only)");
  TORCH_CHECK(key_cache.scalar_type() == at::kHalf || key_cache.scalar_type() == at::kBFloat16,
              "write_kv_cache: dtype ", key_cache.scalar_type(), " is not supported (float16 or bfloat16 only)");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "write_kv_cache: key, value and caches must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == num_tokens && slot_mapping.is_contiguous(),
              "write_kv_cache: slot_mapping must be a contiguous int64 [T]");
  // Each token row must be one contiguous, 16-byte aligned run of kv_heads * head_dim elements.
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == head_dim,
                "write_kv_cache: each key/value row must be contiguous over (kv_heads, head_dim)");
    TORCH_CHECK((t->stride(0) * t->element_size()) % 16 == 0 && aligned16(t->data_ptr()),
                "write_kv_cache: key/value rows must start 16-byte aligned");
  }
  if (num_tokens == 0) return;

  const at::cuda::OptionalCUDAGuard guard(device_of(key));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int row_vecs = static_cast<int>(kv_heads * head_dim / kVecElems);
  LLMSERVE_DISPATCH_HALF_TYPES(key.scalar_type(), "write_kv_cache", [&] {
    write_kv_cache_kernel<scalar_t><<<num_tokens, 128, 0, stream>>>(
        reinterpret_cast<const scalar_t*>(key.data_ptr()), reinterpret_cast<const scalar_t*>(value.data_ptr()),
        reinterpret_cast<scalar_t*>(key_cache.data_ptr()), reinterpret_cast<scalar_t*>(value_cache.data_ptr()),
        slot_mapping.data_ptr<int64_t>(), key.stride(0), value.stride(0), row_vecs);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace llmserve
