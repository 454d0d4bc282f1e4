//! `cargo bench -p llmserve-kernels`: the decode kernel at SmolLM2-135M's attention shape
//! (9 query heads, 3 kv heads, head_dim 64, block 16), batch 64 x 257 tokens (or
//! `cargo bench -p llmserve-kernels --bench decode -- BATCH TOKENS`), 1 and 2 threads, for
//! each KV cache type (f32, bf16, fp8 E4M3 and E5M2: the same random values, narrowed).
//! Prints the median and the minimum of 30 calls (the minimum is the steadier figure on a
//! shared machine), the cache bytes read per second at the median, and the median's ratio to
//! f32's at the same thread count.
//!
//! `cargo bench -p llmserve-kernels --bench decode -- prefill TOKENS` times a prompt's rows
//! instead: one sequence of TOKENS tokens, row i attending over its first i + 1 (how the
//! engine computes a prompt), and prints the attention's GFLOP/s (4 x head_dim per score).

use llmserve_kernels::{paged_decode_attention, Bf16, DecodeShape, Fp8E4M3, Fp8E5M2, KvElem};
use std::time::Instant;

fn main() {
    // optional arguments: batch and tokens per sequence (default 64 x 257)
    let prefill = std::env::args().any(|a| a == "prefill");
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (seqs, len) = match prefill {
        true => (args.first().copied().unwrap_or(1000), args.first().copied().unwrap_or(1000)),
        false => (args.first().copied().unwrap_or(64), args.get(1).copied().unwrap_or(257)),
    };
    let (heads, kvh, d, bs) = (9usize, 3usize, 64usize, 16usize);
    let width = len.div_ceil(bs);
    let num_blocks = if prefill { width } else { seqs * width } + 1;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / 8388608.0 - 1.0
            })
            .collect()
    };
    let k = rnd(num_blocks * bs * kvh * d);
    let v = rnd(num_blocks * bs * kvh * d);
    let q = rnd(seqs * heads * d);
    // interleave the sequences' blocks, as a long-running scheduler would; a prompt's rows
    // all read its one table
    let tables: Vec<i32> = match prefill {
        true => (0..seqs * width).map(|i| (1 + i % width) as i32).collect(),
        false => (0..seqs * width).map(|i| (1 + (i % seqs) * width + i / seqs) as i32).collect(),
    };
    let lens: Vec<i32> = (0..seqs).map(|i| if prefill { i as i32 + 1 } else { len as i32 }).collect();
    let shape = DecodeShape {
        num_seqs: seqs,
        num_heads: heads,
        num_kv_heads: kvh,
        head_dim: d,
        block_size: bs,
        block_table_width: width,
        scale: 0.125,
        window: 0,
        softcap: 0.0,
    };
    let mut f32_medians = [0f64; 2];
    bench::<f32>(&q, &k, &v, &tables, &lens, shape, &mut f32_medians);
    bench::<Bf16>(&q, &k, &v, &tables, &lens, shape, &mut f32_medians);
    bench::<Fp8E4M3>(&q, &k, &v, &tables, &lens, shape, &mut f32_medians);
    bench::<Fp8E5M2>(&q, &k, &v, &tables, &lens, shape, &mut f32_medians);
}

fn bench<E: KvElem>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    tables: &[i32],
    lens: &[i32],
    shape: DecodeShape,
    f32_medians: &mut [f64; 2],
) {
    let (k, v): (Vec<E>, Vec<E>) =
        (k.iter().map(|&x| E::narrow(x)).collect(), v.iter().map(|&x| E::narrow(x)).collect());
    let mut out = vec![0f32; q.len()];
    let prefill = lens.len() > 1 && lens[0] != lens[1];
    let len = lens[0] as usize;
    let bytes = (shape.num_seqs * len * shape.num_kv_heads * shape.head_dim * std::mem::size_of::<E>() * 2) as f64;
    let scores: f64 = lens.iter().map(|&l| l as f64).sum::<f64>() * shape.num_heads as f64;
    for threads in [1, 2] {
        let mut times: Vec<f64> = (0..30)
            .map(|_| {
                let t0 = Instant::now();
                paged_decode_attention(&mut out, q, &k, &v, tables, lens, shape, threads).unwrap();
                t0.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = times[times.len() / 2];
        if E::NAME == "float32" {
            f32_medians[threads - 1] = med;
        }
        let rate = match prefill {
            true => format!("{:.1} GFLOP/s", scores * 4.0 * shape.head_dim as f64 / med / 1e9),
            false => format!("{:.1} GB/s of K/V", bytes / med / 1e9),
        };
        println!(
            "{:>9} threads {threads}: median {:.3} ms, min {:.3} ms, {rate} at the median, {:.2}x f32's speed",
            E::NAME,
            med * 1e3,
            times[0] * 1e3,
            f32_medians[threads - 1] / med
        );
    }
}
