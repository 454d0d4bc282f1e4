//! Property test of the public API: for random shapes, lengths, block tables, sliding windows,
//! soft caps and thread counts the kernel matches a naive f64 reference, and malformed block
//! tables are errors, not panics.

use llmserve_kernels::{paged_decode_attention, DecodeShape};
use proptest::prelude::*;

fn reference(q: &[f32], k: &[f32], v: &[f32], tables: &[i32], lens: &[i32], s: DecodeShape) -> Vec<f32> {
    let (d, g) = (s.head_dim, s.num_heads / s.num_kv_heads);
    let mut out = vec![0f32; q.len()];
    for seq in 0..s.num_seqs {
        for h in 0..s.num_heads {
            let row = |t: usize| {
                let blk = tables[seq * s.block_table_width + t / s.block_size] as usize;
                ((blk * s.block_size + t % s.block_size) * s.num_kv_heads + h / g) * d
            };
            let qh = &q[(seq * s.num_heads + h) * d..][..d];
            let len = lens[seq] as usize;
            let start = if s.window > 0 { len.saturating_sub(s.window) } else { 0 };
            let sc: Vec<f64> = (start..len)
                .map(|t| {
                    let x = qh.iter().zip(&k[row(t)..][..d]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                        * s.scale as f64;
                    let cap = s.softcap as f64;
                    if cap > 0.0 {
                        cap * (x / cap).tanh()
                    } else {
                        x
                    }
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for i in 0..d {
                let a: f64 = w.iter().enumerate().map(|(t, wt)| wt * v[row(start + t) + i] as f64).sum();
                out[(seq * s.num_heads + h) * d + i] = (a / z) as f32;
            }
        }
    }
    out
}

prop_compose! {
    fn case()(kv_heads in 1usize..4, group in 1usize..5, d in 1usize..40, bs in 1usize..9,
              lens in prop::collection::vec(1i32..60, 0..6), threads in 1usize..5, seed in any::<u64>(),
              window in prop_oneof![Just(0usize), 1usize..70],
              softcap in prop_oneof![Just(0f32), 0.05f32..3.0])
        -> (DecodeShape, Vec<i32>, usize, u64) {
        let width = lens.iter().map(|&l| (l as usize).div_ceil(bs)).max().unwrap_or(0);
        (DecodeShape { num_seqs: lens.len(), num_heads: kv_heads * group, num_kv_heads: kv_heads,
                       head_dim: d, block_size: bs, block_table_width: width, scale: 0.3, window,
                       softcap },
         lens, threads, seed)
    }
}

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / 8388608.0 - 1.0
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn matches_reference((s, lens, threads, seed) in case(), perm_seed in any::<u64>()) {
        let used: usize = lens.iter().map(|&l| (l as usize).div_ceil(s.block_size)).sum();
        let num_blocks = used + 1;
        let block = s.block_size * s.num_kv_heads * s.head_dim;
        // every sequence gets distinct blocks, in a seed-dependent rotated order
        let mut tables = vec![0i32; s.num_seqs * s.block_table_width];
        let mut next = 0usize;
        for (i, &l) in lens.iter().enumerate() {
            for b in 0..(l as usize).div_ceil(s.block_size) {
                tables[i * s.block_table_width + b] = ((next + perm_seed as usize % num_blocks) % num_blocks) as i32;
                next += 1;
            }
        }
        let q = data(s.num_seqs * s.num_heads * s.head_dim, seed);
        let k = data(num_blocks * block, seed ^ 0x55);
        let v = data(num_blocks * block, seed ^ 0xAA);
        let mut out = vec![0f32; q.len()];
        paged_decode_attention(&mut out, &q, &k, &v, &tables, &lens, s, threads).unwrap();
        let want = reference(&q, &k, &v, &tables, &lens, s);
        for (a, b) in out.iter().zip(&want) {
            prop_assert!((a - b).abs() < 1e-5, "{} vs {}", a, b);
        }
    }

    #[test]
    fn arbitrary_tables_never_panic((s, lens, threads, seed) in case(), junk in prop::collection::vec(any::<i32>(), 0..40),
                                    nblocks in 0usize..6) {
        let block = s.block_size * s.num_kv_heads * s.head_dim;
        let mut tables = junk;
        tables.resize(s.num_seqs * s.block_table_width, 0);
        let q = data(s.num_seqs * s.num_heads * s.head_dim, seed);
        let k = data(nblocks * block, seed);
        let mut out = vec![0f32; q.len()];
        let r = paged_decode_attention(&mut out, &q, &k, &k, &tables, &lens, s, threads);
        let valid = lens.iter().enumerate().all(|(i, &l)| {
            tables[i * s.block_table_width..][..(l as usize).div_ceil(s.block_size)]
                .iter().all(|&b| b >= 0 && (b as usize) < nblocks)
        });
        prop_assert_eq!(r.is_ok(), valid);
    }
}
