// The paged-attention decode kernels and their launcher; see paged_attention.cu for the work
// split. Included only by the paged_attention_<dtype>_hd<head_dim>.cu units.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <cfloat>

#include "common.cuh"
#include "paged_attention.h"

namespace llmserve {
namespace {

constexpr int kWarps = kThreads / kWarpSize;

// CTAs per SM the register budget is set for. Groups up to 4 are held to 128 registers (4 CTAs
// = 16 warps per SM) so enough loads stay in flight to cover HBM latency; a group of 8 needs
// its 2 x 64 accumulators and gets 2. kPipelined holds the next chunk's K/V in registers too
// (32 more): 3 CTAs for groups up to 4.
template <int kGroup, bool kPipelined>
constexpr int kMinBlocks = kGroup > 4 ? 2 : kPipelined ? 3 : 4;

// grid: (num_kv_heads, num_seqs, num_partitions); block: kThreads. Partition `part` of a
// sequence holds its tokens [part * L, (part + 1) * L) with L = partition_tokens(seq_len, P).
// kPipelined: the loads of chunk c + 1 are issued before chunk c is computed, so the CTA's
// loads stay in flight while it computes (software pipelining), instead of each chunk waiting
// for its own loads. LLMSERVE_DECODE_PIPELINE=1 picks it (kernels.paged_attention_decode);
// not yet measured on a GPU.
template <typename scalar_t, int kHeadDim, int kGroup, bool kPipelined>
// (the template-id is parenthesized: its comma would otherwise split __launch_bounds__'s
// arguments, which only CUDA's variadic definition of the macro puts back together)
__global__ void __launch_bounds__(kThreads, (kMinBlocks<kGroup, kPipelined>)) paged_decode_kernel(const DecodeParams p) {
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
  const bool split = p.num_partitions > 1;
  const int part_len = split ? partition_tokens(seq_len, p.num_partitions) : seq_len;
  const int start = part * part_len;
  const int end = min(seq_len, start + part_len);

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

  // Block ids of this thread's tokens in the next chunk to load, fetched one chunk ahead so
  // the K/V loads never wait on a dependent block-table load.
  int block_ids[kIters];
  auto fetch_ids = [&](int chunk) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int t = chunk + tok_lane + i * kTokensPerPass;
      block_ids[i] = t < end ? table[t / kBlockSize] : 0;
    }
  };
  // This thread's K and V slices of a chunk (zeros past the end: their scores are masked).
  auto load_chunk = [&](int chunk, uint4 (&kv)[kIters], uint4 (&vv)[kIters]) {
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
  };
  fetch_ids(start);
  uint4 kv[kIters], vv[kIters];   // the chunk being computed
  if constexpr (kPipelined) {
    load_chunk(start, kv, vv);
    fetch_ids(start + kChunk);
  }

  for (int chunk = start; chunk < end; chunk += kChunk) {
    // 1. Load K and V: this chunk's, or (pipelined) the next one's while this one computes.
    uint4 kn[kIters], vn[kIters];
    if constexpr (kPipelined) {
      load_chunk(chunk + kChunk, kn, vn);
      fetch_ids(chunk + 2 * kChunk);
    } else {
      load_chunk(chunk, kv, vv);
      fetch_ids(chunk + kChunk);
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
    if constexpr (kPipelined) {
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        kv[i] = kn[i];
        vv[i] = vn[i];
      }
    }
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
// NOTE: the CTA finds the max with each thread reading its own partitions (one round of loads,
// not one per partition), then every thread walks all partitions with 8 iterations unrolled,
// so their loads overlap: a batch-1 step splits a long context into dozens of partitions, and
// a loop that waits on each load costs microseconds per layer.
template <typename scalar_t, int kHeadDim>
__global__ void __launch_bounds__(kHeadDim) paged_decode_reduce_kernel(const DecodeParams p) {
  constexpr int kReduceWarps = kHeadDim / kWarpSize;
  __shared__ float s_max[kReduceWarps];
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int64_t row = (int64_t)seq * p.num_heads + head;
  scalar_t* out = static_cast<scalar_t*>(p.out) + row * kHeadDim;
  const int seq_len = p.seq_lens[seq];
  // Only partitions that hold tokens were written with meaningful values.
  const int part_len = partition_tokens(seq_len, p.num_partitions);
  const int used = min(p.num_partitions, (seq_len + part_len - 1) / part_len);
  if (used <= 0) {
    out[d] = from_float<scalar_t>(0.f);
    return;
  }
  const float* maxes = p.max_logits + row * p.num_partitions;
  const float* sums = p.exp_sums + row * p.num_partitions;
  const float* parts = p.tmp_out + row * p.num_partitions * kHeadDim;
  float m = -FLT_MAX;
  for (int i = d; i < used; i += kHeadDim) m = fmaxf(m, maxes[i]);
  m = warp_max(m);
  if (d % kWarpSize == 0) s_max[d / kWarpSize] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kReduceWarps; ++w) m = fmaxf(m, s_max[w]);
  float num = 0.f, den = 0.f;
#pragma unroll 8
  for (int i = 0; i < used; ++i) {
    const float w = sums[i] * __expf(maxes[i] - m);
    num = fmaf(w, parts[i * kHeadDim + d], num);
    den += w;
  }
  out[d] = from_float<scalar_t>(num / den);
}

}  // namespace

template <typename scalar_t, int kHeadDim, bool kPipelined>
void launch_decode_group(const DecodeParams& p, const dim3 grid, cudaStream_t stream) {
  const int g = p.group_size;
  if (g <= 1) {
    paged_decode_kernel<scalar_t, kHeadDim, 1, kPipelined><<<grid, kThreads, 0, stream>>>(p);
  } else if (g <= 2) {
    paged_decode_kernel<scalar_t, kHeadDim, 2, kPipelined><<<grid, kThreads, 0, stream>>>(p);
  } else if (g <= 4) {
    paged_decode_kernel<scalar_t, kHeadDim, 4, kPipelined><<<grid, kThreads, 0, stream>>>(p);
  } else {
    paged_decode_kernel<scalar_t, kHeadDim, 8, kPipelined><<<grid, kThreads, 0, stream>>>(p);
  }
}

template <typename scalar_t, int kHeadDim>
void launch_paged_decode(const DecodeParams& p, int num_seqs, bool pipelined, cudaStream_t stream) {
  const dim3 grid(p.num_kv_heads, num_seqs, p.num_partitions);
  if (pipelined) {
    launch_decode_group<scalar_t, kHeadDim, true>(p, grid, stream);
  } else {
    launch_decode_group<scalar_t, kHeadDim, false>(p, grid, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.num_partitions > 1) {
    paged_decode_reduce_kernel<scalar_t, kHeadDim>
        <<<dim3(p.num_heads, num_seqs), kHeadDim, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace llmserve

#define LLMSERVE_INSTANTIATE_PAGED_DECODE(SCALAR, HEAD_DIM) \
  template void llmserve::launch_paged_decode<SCALAR, HEAD_DIM>(const llmserve::DecodeParams&, int, bool, cudaStream_t)
