// The torch op registry of llmserve's CUDA extension: schemas (namespace `llmserve`) and their
// CUDA implementations. `Tensor!` marks what an op writes; every op returns nothing, so CUDA
// graphs can capture them and torch.compile sees the mutation. Fake (meta) implementations
// live in python/llmserve/kernels/__init__.py (torch.library.register_fake).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace llmserve {

void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t num_splits, int64_t pipeline);

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping);

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps);

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps);

void silu_and_mul(at::Tensor& out, const at::Tensor& input);

void rotary_embedding(at::Tensor& x, int64_t heads, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace llmserve

TORCH_LIBRARY(llmserve, m) {
  // out [S, H, D] <- attention of query [S, H, D] over caches [N, 16, KVH, D] through
  // block_tables [S, W] int32 and seq_lens [S] int32; pipeline 1: the software-pipelined kernel.
  m.def(
      "paged_attention_decode(Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int num_splits, int pipeline=0) -> ()");
  // key/value [T, KVH, D] -> caches [N, block_size, KVH, D] at slot_mapping [T] int64 (-1 skips).
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
      "Tensor slot_mapping) -> ()");
  // The fused layer ops (layer_ops.cu), rounding where the eager torch code rounds.
  // out [T, H] <- RMSNorm of input [T, H] times weight [H] (input's dtype or float32).
  m.def("rms_norm(Tensor! out, Tensor input, Tensor weight, float eps) -> ()");
  // residual [T, H] += input; then input <- RMSNorm of residual times weight [H].
  m.def("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float eps) -> ()");
  // out [T, I] <- silu(input[:, :I]) * input[:, I:] for input [T, 2I].
  m.def("silu_and_mul(Tensor! out, Tensor input) -> ()");
  // x [T, W]: rotate-half RoPE in place on its first `heads` heads; cos/sin [T, head_dim / 2].
  m.def("rotary_embedding(Tensor! x, int heads, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve, CUDA, m) {
  m.impl("paged_attention_decode", &llmserve::paged_attention_decode);
  m.impl("write_kv_cache", &llmserve::write_kv_cache);
  m.impl("rms_norm", &llmserve::rms_norm);
  m.impl("fused_add_rms_norm", &llmserve::fused_add_rms_norm);
  m.impl("silu_and_mul", &llmserve::silu_and_mul);
  m.impl("rotary_embedding", &llmserve::rotary_embedding);
}
