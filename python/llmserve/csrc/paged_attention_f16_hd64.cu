// The decode kernels for __half caches with head_dim 64 (paged_attention_kernels.cuh).
#include "paged_attention_kernels.cuh"

LLMSERVE_INSTANTIATE_PAGED_DECODE(__half, 64);
