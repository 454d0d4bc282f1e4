//! `cargo bench -p llmserve-kernels`: the decode kernel at SmolLM2-135M's attention shape
//! (9 query heads, 3 kv heads, head_dim 64, block 16), batch 64 x 257 tokens (or
//! `cargo bench -p llmserve-kernels --bench decode -- BATCH TOKENS`), 1 and 2 threads.
//! Prints the median and the minimum of 30 calls (the minimum is the steadier figure on a
//! shared machine) and the K/V bytes read per second at the median.

use llmserve_kernels::{paged_decode_attention, DecodeShape};
use std::time::Instant;

fn main() {
    // optional arguments: batch and tokens per sequence (default 64 x 257)
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (seqs, len) = (args.first().copied().unwrap_or(64), args.get(1).copied().unwrap_or(257));
    let (heads, kvh, d, bs) = (9usize, 3usize, 64usize, 16usize);
    let width = len.div_ceil(bs);
    let num_blocks = seqs * width + 1;
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
    // interleave the sequences' blocks, as a long-running scheduler would
    let tables: Vec<i32> = (0..seqs * width).map(|i| (1 + (i % seqs) * width + i / seqs) as i32).collect();
    let lens = vec![len as i32; seqs];
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
    let mut out = vec![0f32; q.len()];
    let bytes = (seqs * len * kvh * d * 4 * 2) as f64;
    for threads in [1, 2] {
        let mut times: Vec<f64> = (0..30)
            .map(|_| {
                let t0 = Instant::now();
                paged_decode_attention(&mut out, &q, &k, &v, &tables, &lens, shape, threads).unwrap();
                t0.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = times[times.len() / 2];
        println!(
            "threads {threads}: median {:.3} ms, min {:.3} ms, {:.1} GB/s of K/V at the median",
            med * 1e3,
            times[0] * 1e3,
            bytes / med / 1e9
        );
    }
}
