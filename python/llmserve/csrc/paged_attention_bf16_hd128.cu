// The decode kernels for __nv_bfloat16 caches with head_dim 128 (paged_attention_kernels.cuh).
#include "paged_attention_kernels.cuh"

LLMSERVE_INSTANTIATE_PAGED_DECODE(__nv_bfloat16, 128);
