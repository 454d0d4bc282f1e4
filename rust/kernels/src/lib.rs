//! llmserve-kernels: CPU compute kernels of llmserve, in pure Rust (no PyO3, no torch).
//!
//! - [`paged_decode_attention`]: attention of one query token per sequence over that
//!   sequence's keys and values, read in place through its block table from the paged KV cache
//!   (no gather copy), which holds f32, bfloat16 or fp8 ([`kv_elem`]); bound in
//!   `rust/bindings/src/kernels.rs`.
//! - [`apply_token_bitmask`]: a grammar's packed token bitmask applied to logits rows in place
//!   (forbidden tokens -> -inf); bound in `rust/bindings/src/kernels.rs`.
//! - [`quant`]: matrix-vector products over GGUF quantized blocks (see its module doc).
//! - [`layer`]: a whole decoder layer for a step of decode tokens over quantized weights.
//!
//! The binding crate hands these numpy views of torch's CPU tensors.
//!
//! Invariants:
//! - Every length, shape and block id is validated before any work starts; a bad argument is an
//!   `Err(String)`, never a panic or an out-of-bounds read.
//! - The result does not depend on the thread count (each (sequence, kv head) work item is
//!   computed by one thread, in token order).
//! - SIMD is chosen at run time: the crate is built for generic x86_64 and uses its AVX2+FMA
//!   code only where `is_x86_feature_detected!` says the CPU has both (the decode kernel also
//!   F16C, which widens fp8 caches), and the decode kernel its AVX-512 code only where the CPU
//!   also has AVX-512F.

mod bitmask;
mod decode;
pub mod kv_elem;
pub mod layer;
mod pool;
pub mod quant;
mod simd;

pub use bitmask::apply_token_bitmask;

/// The revision of the CPU numerics (these kernels', and which path computes what): bumped
/// whenever a change moves the bits a CPU step outputs for the same input (a kernel's
/// summation order or rounding, an op the Rust path takes over from torch, a step that reads
/// other weights), so that a seeded request's tokens may differ from the last build's. `system_fingerprint` hashes it (exported as `_core.numerics_revision`).
/// `tests/quant.rs` pins the quantized GEMV's bits to it, `layer/tests.rs` a whole decoder
/// layer's (attention included).
///
/// 1: the first fingerprinted kernels. 2: the GEMV reads weights packed 8 rows at a time, and a
/// block's integer sum converts to f32 once. 3: `CpuDecoder` applies the model's final norm
/// (f64 sum of squares, as the layers' norms) in place of torch's `rms_norm`. 4: the rows a
/// step samples read the LM head's GGUF blocks in every step but decode steps of more than 24
/// sequences (steps with prompt tokens used its fp32 weights). 5: on CPUs with AVX-512, attention
/// scores are two running sums each (even and odd head-dim positions), with a tile's keys in lanes, and a tile's
/// softmax weights are computed 16 lanes at a time with fused multiply-adds (AVX2 CPUs keep
/// revision 4's bits).
pub const NUMERICS_REVISION: u32 = 5;
pub use decode::{paged_decode_attention, DecodeShape};
pub use kv_elem::{Bf16, Fp8E4M3, Fp8E5M2, KvElem};

#[cfg(test)]
mod tests;
