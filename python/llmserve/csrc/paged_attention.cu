// llmserve::paged_attention_decode: one query token per sequence attending over its paged KV
// cache (the decode path; prefill runs through torch SDPA, see cuda_attention.py).
//
// Work split (GQA-aware): one CTA per (kv head, sequence, partition). The CTA loads the kv
// head's K/V once and serves every query head of its group from it, so K/V bytes are read
// once per kv head, not once per query head. A sequence's context is cut into partitions of
// `partition_size` tokens (split-K) so that a small batch still gives the GPU enough CTAs; a
// second kernel merges the partitions' partial results by their log-sum-exp. With one
// partition the first kernel writes the output directly.
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
// to 8 (rounded up to 1, 2, 4 or 8 for the register arrays).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <cfloat>

#include "common.cuh"

namespace llmserve {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kBlockSize = 16;       // tokens per KV-cache block (the only one served)
constexpr int kMaxGroupSize = 8;     // query heads per kv head
constexpr int kPartitionMultiple = 64;  // partition_size must be a multiple (covers every chunk)

struct DecodeParams {
  void* out;                    // [S, H, D] (written when num_partitions == 1)
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
  int partition_size;           // tokens per partition; 0 = the whole sequence (P == 1)
  int num_partitions;           // P
  float scale;
};

// grid: (num_kv_heads, num_seqs, num_partitions); block: kThreads.
// NOTE: groups up to 4 are held to 128 registers (4 CTAs = 16 warps per SM) so enough loads
// stay in flight to cover HBM latency; a group of 8 needs its 2 x 64 accumulators and gets 2.
template <typename scalar_t, int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kThreads, kGroup <= 4 ? 4 : 2) paged_decode_kernel(const DecodeParams p) {
  constexpr int kVecs = kHeadDim / kVecElems;            // 16-byte vectors per head row: 8 | 16
  constexpr int kTokensPerPass = kThreads / kVecs;       // tokens the CTA covers per load: 16 | 8
  constexpr int kIters = 4;                              // loads in flight per thread per chunk
  constexpr int kChunk = kTokensPerPass * kIters;        // tokens per online-softmax step: 64 | 32
  constexpr int kPerLane = kChunk / kWarpSize;           // softmax values per lane: 2 | 1
  constexpr int kRowsPerWarp = (kGroup + kWarps - 1) / kWarps;
  static_assert(kPartitionMultiple % kChunk == 0, "partitions must hold whole chunks");

  const int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int vec = tid % kVecs;              // which 16-byte slice of a head row
  const int tok_lane = tid / kVecs;         // which token of a pass
  const int group = p.group_size;
  const int head0 = kv_head * group;
  const int seq_len = p.seq_lens[seq];
  const int start = p.partition_size > 0 ? part * p.partition_size : 0;
  const int end = p.partition_size > 0 ? min(seq_len, start + p.partition_size) : seq_len;
  const bool split = p.num_partitions > 1;

  if (start >= end) {
    // An empty partition (context shorter than this split) or a padding row.
    if (split) {
      if (tid < group) {
        const int64_t i = ((int64_t)seq * p.num_heads + head0 + tid) * p.num_partitions + part;
        p.max_logits[i] = -FLT_MAX;
        p.exp_sums[i] = 0.f;
      }
    } else {
      scalar_t* out = static_cast<scalar_t*>(p.out) + ((int64_t)seq * p.num_heads + head0) * kHeadDim;
      for (int i = tid; i < group * kHeadDim; i += kThreads) out[i] = from_float<scalar_t>(0.f);
    }
    return;
  }

  __shared__ float s_logits[kGroup][kChunk];
  __shared__ float s_alpha[kGroup];
  __shared__ float s_max[kGroup], s_sum[kGroup];
  __shared__ float s_red[kWarps][kGroup][kHeadDim];

  // This thread's slice of every query of the group, pre-scaled.
  float q[kGroup][kVecElems];
  const scalar_t* q_base = static_cast<const scalar_t*>(p.query) + seq * p.query_stride;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (g < group) {
      const uint4 raw = *reinterpret_cast<const uint4*>(q_base + (head0 + g) * kHeadDim + vec * kVecElems);
      vec_to_float<scalar_t>(raw, q[g]);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) q[g][j] *= p.scale;
    } else {
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) q[g][j] = 0.f;
    }
  }

  float acc[kGroup][kVecElems];
#pragma unroll
  for (int g = 0; g < kGroup; ++g)
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) acc[g][j] = 0.f;
  float m_run[kRowsPerWarp], s_run[kRowsPerWarp];   // softmax state of the rows this warp owns
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) { m_run[r] = -FLT_MAX; s_run[r] = 0.f; }

  const int* table = p.block_tables + (int64_t)seq * p.block_table_stride;
  const int64_t token_stride = (int64_t)p.num_kv_heads * kHeadDim;   // elements per cache slot
  const int64_t head_offset = (int64_t)kv_head * kHeadDim + vec * kVecElems;
  const scalar_t* k_cache = static_cast<const scalar_t*>(p.key_cache);
  const scalar_t* v_cache = static_cast<const scalar_t*>(p.value_cache);

  // Block ids of this thread's tokens in the next chunk, fetched one chunk ahead so the K/V
  // loads never wait on a dependent block-table load.
  int block_ids[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int t = start + tok_lane + i * kTokensPerPass;
    block_ids[i] = t < end ? table[t / kBlockSize] : 0;
  }

  for (int chunk = start; chunk < end; chunk += kChunk) {
    // 1. Load this chunk's K and V slices (zeros past the end: their scores are masked).
    uint4 kv[kIters], vv[kIters];
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int t = chunk + tok_lane + i * kTokensPerPass;
      kv[i] = make_uint4(0, 0, 0, 0);
      vv[i] = make_uint4(0, 0, 0, 0);
      if (t < end) {
        const int64_t slot = (int64_t)block_ids[i] * kBlockSize + t % kBlockSize;
        const int64_t off = slot * token_stride + head_offset;
        kv[i] = __ldg(reinterpret_cast<const uint4*>(k_cache + off));
        vv[i] = __ldg(reinterpret_cast<const uint4*>(v_cache + off));
      }
    }
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int t = chunk + kChunk + tok_lane + i * kTokensPerPass;
      block_ids[i] = t < end ? table[t / kBlockSize] : 0;
    }
    // 2. Scores q_g . k_t, reduced across the kVecs threads that share a token.
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      float k[kVecElems];
      vec_to_float<scalar_t>(kv[i], k);
      const int t_local = tok_lane + i * kTokensPerPass;
      const bool valid = chunk + t_local < end;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        // rows past the real group size pad kGroup: skip their work (`group` is the same for
        // every thread of the CTA, so the shuffles below stay convergent)
        if (g >= group) break;
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) dot = fmaf(q[g][j], k[j], dot);
#pragma unroll
        for (int o = kVecs / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (vec == 0) s_logits[g][t_local] = valid ? dot : -INFINITY;
      }
    }
    __syncthreads();
    // 3. Online softmax: warp w owns rows w, w + kWarps, ...
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int g = warp + r * kWarps;
      if (g < group) {
        float x[kPerLane];
        float m_chunk = -FLT_MAX;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          x[i] = s_logits[g][lane + i * kWarpSize];
          m_chunk = fmaxf(m_chunk, x[i]);
        }
        const float m_new = fmaxf(m_run[r], warp_max(m_chunk));
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const float e = __expf(x[i] - m_new);   // masked tokens: exp(-inf) = 0
          s_logits[g][lane + i * kWarpSize] = e;
          sum += e;
        }
        const float alpha = __expf(m_run[r] - m_new);
        s_run[r] = s_run[r] * alpha + warp_sum(sum);
        m_run[r] = m_new;
        if (lane == 0) s_alpha[g] = alpha;
      }
    }
    __syncthreads();
    // 4. acc = acc * alpha + sum_t p_t * v_t for this thread's tokens and slice.
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (g < group) {
        const float a = s_alpha[g];
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) acc[g][j] *= a;
      }
    }
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      float v[kVecElems];
      vec_to_float<scalar_t>(vv[i], v);
      const int t_local = tok_lane + i * kTokensPerPass;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (g < group) {
          const float pg = s_logits[g][t_local];
#pragma unroll
          for (int j = 0; j < kVecElems; ++j) acc[g][j] = fmaf(pg, v[j], acc[g][j]);
        }
      }
    }
    __syncthreads();   // s_logits / s_alpha are rewritten by the next chunk
  }

  // Sum acc over the token lanes: first within the warp (lanes kVecs apart share a slice),
  // then across warps through shared memory.
#pragma unroll
  for (int g = 0; g < kGroup; ++g)
#pragma unroll
    for (int j = 0; j < kVecElems; ++j)
#pragma unroll
      for (int o = kVecs; o < kWarpSize; o <<= 1) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
  if (lane < kVecs) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g)
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) s_red[warp][g][vec * kVecElems + j] = acc[g][j];
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int g = warp + r * kWarps;
    if (g < group && lane == 0) {
      s_max[g] = m_run[r];
      s_sum[g] = s_run[r];
    }
  }
  __syncthreads();

  for (int i = tid; i < group * kHeadDim; i += kThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += s_red[w][g][d];
    o /= s_sum[g];   // >= 1: the row's max contributes exp(0)
    const int64_t row = (int64_t)seq * p.num_heads + head0 + g;
    if (split) {
      p.tmp_out[(row * p.num_partitions + part) * kHeadDim + d] = o;
      if (d == 0) {
        p.max_logits[row * p.num_partitions + part] = s_max[g];
        p.exp_sums[row * p.num_partitions + part] = s_sum[g];
      }
    } else {
      static_cast<scalar_t*>(p.out)[row * kHeadDim + d] = from_float<scalar_t>(o);
    }
  }
}

// Merge partitions: out = sum_i w_i o_i / sum_i w_i with w_i = exp_sum_i * exp(max_i - max).
// grid: (num_heads, num_seqs); block: kHeadDim threads, one output element each.
template <typename scalar_t, int kHeadDim>
__global__ void __launch_bounds__(kHeadDim) paged_decode_reduce_kernel(const DecodeParams p) {
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int64_t row = (int64_t)seq * p.num_heads + head;
  scalar_t* out = static_cast<scalar_t*>(p.out) + row * kHeadDim;
  const int seq_len = p.seq_lens[seq];
  // Only partitions that hold tokens were written with meaningful values.
  const int used = min(p.num_partitions, (seq_len + p.partition_size - 1) / p.partition_size);
  if (used <= 0) {
    out[d] = from_float<scalar_t>(0.f);
    return;
  }
  const float* maxes = p.max_logits + row * p.num_partitions;
  const float* sums = p.exp_sums + row * p.num_partitions;
  const float* parts = p.tmp_out + row * p.num_partitions * kHeadDim;
  float m = -FLT_MAX;
  for (int i = 0; i < used; ++i) m = fmaxf(m, maxes[i]);
  float num = 0.f, den = 0.f;
  for (int i = 0; i < used; ++i) {
    const float w = sums[i] * __expf(maxes[i] - m);
    num = fmaf(w, parts[i * kHeadDim + d], num);
    den += w;
  }
  out[d] = from_float<scalar_t>(num / den);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

template <typename scalar_t, int kHeadDim>
void launch(const DecodeParams& p, int num_seqs, cudaStream_t stream) {
  const dim3 grid(p.num_kv_heads, num_seqs, p.num_partitions);
  const int g = p.group_size;
  if (g <= 1) {
    paged_decode_kernel<scalar_t, kHeadDim, 1><<<grid, kThreads, 0, stream>>>(p);
  } else if (g <= 2) {
    paged_decode_kernel<scalar_t, kHeadDim, 2><<<grid, kThreads, 0, stream>>>(p);
  } else if (g <= 4) {
    paged_decode_kernel<scalar_t, kHeadDim, 4><<<grid, kThreads, 0, stream>>>(p);
  } else {
    paged_decode_kernel<scalar_t, kHeadDim, 8><<<grid, kThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.num_partitions > 1) {
    paged_decode_reduce_kernel<scalar_t, kHeadDim>
        <<<dim3(p.num_heads, num_seqs), kHeadDim, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

// out [S, H, D] (written); query [S, H, D] (rows may be strided, each head row contiguous);
// key_cache/value_cache [num_blocks, 16, KVH, D]; block_tables [S, W] int32; seq_lens [S]
// int32 (context length including this step's token, <= W * 16; 0 = padding row -> zeros);
// partition_size: tokens per split-K partition, a multiple of 64, or 0 for no split.
void paged_attention_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& seq_lens, double scale, int64_t partition_size) {
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
  TORCH_CHECK(partition_size >= 0 && partition_size % kPartitionMultiple == 0, name, ": partition_size ",
              partition_size, " must be 0 or a multiple of ", kPartitionMultiple);
  if (num_seqs == 0) return;

  const int64_t max_context = block_tables.size(1) * kBlockSize;
  int64_t num_partitions = partition_size > 0 ? (max_context + partition_size - 1) / partition_size : 1;
  if (num_partitions <= 1) {
    num_partitions = 1;
    partition_size = 0;
  }
  TORCH_CHECK(num_partitions <= 65535, name, ": too many partitions (", num_partitions, ")");

  const at::cuda::OptionalCUDAGuard guard(device_of(query));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  torch::Tensor tmp_out, max_logits, exp_sums;   // split-K scratch (allocated on the stream; graph-safe)
  if (num_partitions > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    tmp_out = torch::empty({num_seqs, num_heads, num_partitions, head_dim}, f32);
    max_logits = torch::empty({num_seqs, num_heads, num_partitions}, f32);
    exp_sums = torch::empty({num_seqs, num_heads, num_partitions}, f32);
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
  p.partition_size = static_cast<int>(partition_size);
  p.num_partitions = static_cast<int>(num_partitions);
  p.scale = static_cast<float>(scale);

  LLMSERVE_DISPATCH_HALF_TYPES(dtype, name, [&] {
    LLMSERVE_DISPATCH_HEAD_DIM(head_dim, name, [&] { launch<scalar_t, kHeadDim>(p, num_seqs, stream); });
  });
}

}  // namespace llmserve
