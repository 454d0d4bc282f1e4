// llmserve::paged_attention_decode: one query token per sequence attending over its paged KV
// cache (the decode path; prefill runs through torch SDPA, see cuda_attention.py).
//
// Work split (GQA-aware): one CTA per (kv head, sequence, partition). The CTA loads the kv
// head's K/V once and serves every query head of its group from it, so K/V bytes are read
// once per kv head, not once per query head. A sequence's context is cut into `num_splits`
// partitions (split-K) so that a small batch still gives the GPU enough CTAs; a second kernel
// merges the partitions' partial results by their log-sum-exp. Each partition's length follows
// the sequence's own length (partition_tokens), read on the device: the grid depends only on
// the batch shape, so one CUDA graph serves every context. With one partition the first
// kernel writes the output directly.
//
// Inside a CTA, 128 threads walk the partition in chunks with an online softmax in fp32:
//   scores: each token's head row (head_dim elements) is read as head_dim / 8 16-byte vectors,
//           one per thread; the dot products with the group's G queries are reduced across
//           those threads with warp shuffles and land in shared memory [G, chunk].
//   softmax: one warp per query row: chunk max, rescale factor, exp, running sum.
//   values: the same thread -> (token, 16-byte slice) mapping reads V and accumulates
//           acc[g][8] += p[g][t] * v[t][slice] in registers.
// K and V of a chunk are loaded together up front, with the block ids they need fetched one
// chunk ahead, so each chunk costs one memory round trip.
//
// Only what we serve is instantiated: fp16/bf16, head_dim 64/128, block_size 16, GQA group up
// to 8 (rounded up to 1, 2, 4 or 8 for the register arrays). This file holds the op's checks and
// dispatch; the kernels are in paged_attention_kernels.cuh, compiled by the four
// paged_attention_<dtype>_hd<head_dim>.cu units.
// Host code only (built by the C++ compiler): the kernels are in paged_attention_kernels.cuh.
#include <ATen/DeviceGuard.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "dispatch.h"
#include "paged_attention.h"

namespace llmserve {
namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace

// out [S, H, D] (written); query [S, H, D] (rows may be strided, each head row contiguous);
// key_cache/value_cache [num_blocks, 16, KVH, D]; block_tables [S, W] int32; seq_lens [S]
// int32 (context length including this step's token, <= W * 16; 0 = padding row -> zeros);
// num_splits: split-K partitions per sequence (0 or 1: no split; capped at what the widest
// context, W * 16 tokens, fills with 64-token partitions);
// pipeline: 1 runs the software-pipelined kernel (the next chunk's loads issued before this
// chunk computes), 0 the one that loads each chunk and then computes it.
void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t num_splits, int64_t pipeline) {
  const char* name = "paged_attention_decode";
  TORCH_CHECK(out.is_cuda() && query.is_cuda() && key_cache.is_cuda() && value_cache.is_cuda() &&
                  block_tables.is_cuda() && seq_lens.is_cuda(),
              name, ": every tensor must be on a CUDA device");
  TORCH_CHECK(query.dim() == 3, name, ": query must be [S, heads, head_dim]");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), name,
              ": out must be a contiguous tensor shaped like query");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), name,
              ": caches must both be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), name, ": caches must be contiguous");
  TORCH_CHECK(key_cache.size(1) == kBlockSize, name, ": block_size ", key_cache.size(1),
              " is not supported (16 only)");
  TORCH_CHECK(key_cache.size(3) == head_dim, name, ": query head_dim ", head_dim, " != cache head_dim ",
              key_cache.size(3));
  TORCH_CHECK(head_dim == 64 || head_dim == 128, name, ": head_dim ", head_dim, " is not supported (64 or 128 only)");
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, name, ": ", num_heads,
              " query heads do not divide into ", num_kv_heads, " kv heads");
  const int64_t group = num_heads / num_kv_heads;
  TORCH_CHECK(group <= kMaxGroupSize, name, ": ", group, " query heads per kv head; at most ", kMaxGroupSize,
              " are supported");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, name, ": dtype ", dtype,
              " is not supported (float16 or bfloat16 only)");
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              name, ": query, out and caches must share one dtype");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == head_dim, name,
              ": each query token's heads must be contiguous [heads, head_dim]");
  TORCH_CHECK((query.stride(0) * query.element_size()) % 16 == 0 && aligned16(query.data_ptr()), name,
              ": query rows must start 16-byte aligned");
  TORCH_CHECK(aligned16(key_cache.data_ptr()) && aligned16(value_cache.data_ptr()), name,
              ": caches must be 16-byte aligned");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == num_seqs && block_tables.stride(1) == 1,
              name, ": block_tables must be int32 [S, W] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs &&
                  seq_lens.is_contiguous(),
              name, ": seq_lens must be a contiguous int32 [S]");
  TORCH_CHECK(pipeline == 0 || pipeline == 1, name, ": pipeline must be 0 or 1, got ", pipeline);
  TORCH_CHECK(num_splits >= 0 && num_splits <= 65535, name, ": num_splits ", num_splits,
              " must be in [0, 65535]");
  if (num_seqs == 0) return;

  // (no context is longer than the table is wide: more partitions than 64-token ones of
  // W * 16 tokens would all stay empty)
  const int64_t max_context = block_tables.size(1) * kBlockSize;
  const int64_t num_partitions =
      std::max<int64_t>(1, std::min(num_splits, (max_context + kPartitionMultiple - 1) / kPartitionMultiple));

  const at::cuda::OptionalCUDAGuard guard(device_of(query));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor tmp_out, max_logits, exp_sums;   // split-K scratch (allocated on the stream; graph-safe)
  if (num_partitions > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    tmp_out = at::empty({num_seqs, num_heads, num_partitions, head_dim}, f32);
    max_logits = at::empty({num_seqs, num_heads, num_partitions}, f32);
    exp_sums = at::empty({num_seqs, num_heads, num_partitions}, f32);
  }

  DecodeParams p;
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.tmp_out = num_partitions > 1 ? tmp_out.data_ptr<float>() : nullptr;
  p.max_logits = num_partitions > 1 ? max_logits.data_ptr<float>() : nullptr;
  p.exp_sums = num_partitions > 1 ? exp_sums.data_ptr<float>() : nullptr;
  p.query_stride = query.stride(0);
  p.block_table_stride = static_cast<int>(block_tables.stride(0));
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.group_size = static_cast<int>(group);
  p.num_partitions = static_cast<int>(num_partitions);
  p.scale = static_cast<float>(scale);

  LLMSERVE_DISPATCH_HALF_TYPES(dtype, name, [&] {
    LLMSERVE_DISPATCH_HEAD_DIM(head_dim, name,
                               [&] { launch_paged_decode<scalar_t, kHeadDim>(p, num_seqs, pipeline != 0, stream); });
  });
}

}  // namespace llmserve
