// What the host op (paged_attention.cu) and the kernels' translation units
// (paged_attention_<dtype>_hd<head_dim>.cu) share: the constants, the kernels' parameters, and
// the launcher each of those units instantiates for one dtype and head size. The kernels are
// compiled in four units so that a machine with many cores builds them in parallel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace llmserve {

constexpr int kThreads = 128;
constexpr int kBlockSize = 16;       // tokens per KV-cache block (the only one served)
constexpr int kMaxGroupSize = 8;     // query heads per kv head
constexpr int kPartitionMultiple = 64;  // a partition holds whole chunks: a multiple of this

struct DecodeParams {
  void* out;                    // [S, H, D]
  const void* query;            // [S, H, D], row stride query_stride
  const void* key_cache;        // [num_blocks, 16, KVH, D]
  const void* value_cache;      // [num_blocks, 16, KVH, D]
  const int* block_tables;      // [S, W]
  const int* seq_lens;          // [S]; 0 = padding row (output zeros)
  float* tmp_out;               // [S, H, P, D]  per-partition normalized outputs
  float* max_logits;            // [S, H, P]
  float* exp_sums;              // [S, H, P]
  int64_t query_stride;
  int block_table_stride;
  int num_heads, num_kv_heads, group_size;
  int num_partitions;           // P: splits of every sequence's context (1: no split)
  float scale;
};

// Tokens per partition of a sequence of seq_len tokens cut into at most `splits` (> 1): an
// even share rounded up to whole chunks, so a sequence's partitions follow its own length, not
// the block table's width (its last partitions stay empty when the context is short).
__host__ __device__ inline int partition_tokens(int seq_len, int splits) {
  const int share = (seq_len + splits - 1) / splits;
  const int rounded = (share + kPartitionMultiple - 1) / kPartitionMultiple * kPartitionMultiple;
  return rounded > kPartitionMultiple ? rounded : kPartitionMultiple;
}

// Launch the decode kernel (and the partition merge when split) for one dtype and head size on
// `stream`; defined in paged_attention_kernels.cuh, instantiated once per kernels unit.
template <typename scalar_t, int kHeadDim>
void launch_paged_decode(const DecodeParams& p, int num_seqs, bool pipelined, cudaStream_t stream);

}  // namespace llmserve
