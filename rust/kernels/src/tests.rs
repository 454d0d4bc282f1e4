//! Kernel vs a naive f64 reference (gather the sequence's rows, softmax, weighted sum), on both
//! instruction-set paths and several thread counts; and the argument checks.

use crate::decode::{run, DecodeShape, Isa};

/// Deterministic xorshift numbers in [-1, 1): no rand dependency for the unit tests.
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub(crate) fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32() * amp).collect()
    }
}

pub(crate) struct Case {
    pub shape: DecodeShape,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub tables: Vec<i32>,
    pub lens: Vec<i32>,
}

/// Sequences of the given lengths, blocks handed out in a shuffled order (block 0 unused, as
/// the scheduler's null block), padded table entries left 0.
pub(crate) fn make_case(seed: u64, heads: usize, kv_heads: usize, d: usize, bs: usize, lens: &[i32]) -> Case {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let width = lens.iter().map(|&l| (l as usize).div_ceil(bs)).max().unwrap_or(0) + 1;
    let used: usize = lens.iter().map(|&l| (l as usize).div_ceil(bs)).sum();
    let num_blocks = used + 3;
    let mut ids: Vec<i32> = (1..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.next() as usize % (i + 1));
    }
    let mut tables = vec![0i32; lens.len() * width];
    let mut next = 0;
    for (s, &l) in lens.iter().enumerate() {
        for b in 0..(l as usize).div_ceil(bs) {
            tables[s * width + b] = ids[next];
            next += 1;
        }
    }
    let block = bs * kv_heads * d;
    let shape = DecodeShape {
        num_seqs: lens.len(),
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: d,
        block_size: bs,
        block_table_width: width,
        scale: (d as f32).powf(-0.5),
        window: 0,
        softcap: 0.0,
    };
    Case {
        shape,
        q: rng.vec(lens.len() * heads * d, 2.0),
        k: rng.vec(num_blocks * block, 2.0),
        v: rng.vec(num_blocks * block, 1.0),
        tables,
        lens: lens.to_vec(),
    }
}

pub(crate) fn reference(c: &Case) -> Vec<f32> {
    let s = c.shape;
    let (d, g) = (s.head_dim, s.num_heads / s.num_kv_heads);
    let mut out = vec![0f32; c.q.len()];
    for seq in 0..s.num_seqs {
        let len = c.lens[seq] as usize;
        for h in 0..s.num_heads {
            let kvh = h / g;
            let q = &c.q[(seq * s.num_heads + h) * d..][..d];
            let row = |t: usize| {
                let blk = c.tables[seq * s.block_table_width + t / s.block_size] as usize;
                ((blk * s.block_size + t % s.block_size) * s.num_kv_heads + kvh) * d
            };
            let start = if s.window > 0 { len.saturating_sub(s.window) } else { 0 };
            let cap = s.softcap as f64;
            let scores: Vec<f64> = (0..len)
                .map(|t| {
                    if t < start {
                        return f64::NEG_INFINITY; // before the sliding window
                    }
                    let k = &c.k[row(t)..][..d];
                    let x = q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * s.scale as f64;
                    if cap > 0.0 {
                        cap * (x / cap).tanh()
                    } else {
                        x
                    }
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for i in 0..d {
                let acc: f64 = (0..len).map(|t| w[t] * c.v[row(t) + i] as f64).sum();
                out[(seq * s.num_heads + h) * d + i] = (acc / sum) as f32;
            }
        }
    }
    out
}

pub(crate) fn isas() -> Vec<Isa> {
    Isa::supported()
}

fn run_case(c: &Case, threads: usize, isa: Isa) -> Vec<f32> {
    let mut out = vec![f32::NAN; c.q.len()];
    run(&mut out, &c.q, &c.k, &c.v, &c.tables, &c.lens, c.shape, threads, isa).unwrap();
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn matches_reference_across_gqa_head_dims_and_lengths() {
    let lens = [1, 5, 16, 17, 33, 64, 100, 255];
    for (heads, kv_heads) in [(4, 4), (9, 3), (16, 2)] {
        for d in [64, 128] {
            let c = make_case((heads * 1000 + d) as u64, heads, kv_heads, d, 16, &lens);
            let want = reference(&c);
            for isa in isas() {
                let got = run_case(&c, 1, isa);
                let err = max_abs_diff(&got, &want);
                assert!(err < 2e-5, "heads {heads}/{kv_heads} d {d} {isa:?}: max diff {err}");
            }
        }
    }
}

#[test]
fn a_sliding_window_reads_only_its_last_tokens() {
    // windows that start mid-block, on a block boundary, and hold the whole sequence
    let lens = [1, 5, 16, 17, 33, 64, 100, 255];
    for window in [1, 7, 16, 40, 300] {
        for d in [64, 24] {
            let mut c = make_case(window as u64 * 7 + d as u64, 9, 3, d, 16, &lens);
            c.shape.window = window;
            let want = reference(&c);
            for isa in isas() {
                let err = max_abs_diff(&run_case(&c, 2, isa), &want);
                assert!(err < 2e-5, "window {window} d {d} {isa:?}: max diff {err}");
            }
        }
    }
}

#[test]
fn soft_capped_scores() {
    // caps below and above the scores' range (q and k in [-2, 2): scaled scores up to ~16 at d
    // 64), with and without a window; a cap of 0 is no cap (the first test)
    let lens = [1, 17, 64, 100];
    for (cap, window) in [(0.5, 0), (4.0, 0), (50.0, 0), (4.0, 7)] {
        for d in [64, 24] {
            let mut c = make_case(d as u64 * 13 + window as u64, 9, 3, d, 16, &lens);
            c.shape.softcap = cap;
            c.shape.window = window;
            let want = reference(&c);
            for isa in isas() {
                let err = max_abs_diff(&run_case(&c, 2, isa), &want);
                assert!(err < 2e-5, "softcap {cap} window {window} d {d} {isa:?}: max diff {err}");
            }
        }
    }
    // a cap changes the result where scores exceed it
    let mut c = make_case(5, 4, 4, 64, 16, &lens);
    let uncapped = run_case(&c, 1, Isa::Generic);
    c.shape.softcap = 0.5;
    assert!(max_abs_diff(&run_case(&c, 1, Isa::Generic), &uncapped) > 1e-3);
}

#[test]
fn odd_sizes_block_sizes_and_head_dims() {
    for (bs, d) in [(1, 8), (3, 13), (7, 40), (32, 80), (256, 64)] {
        let c = make_case((bs * 31 + d) as u64, 6, 2, d, bs, &[1, 2, 9, 70, 300]);
        let want = reference(&c);
        for isa in isas() {
            let err = max_abs_diff(&run_case(&c, 2, isa), &want);
            assert!(err < 2e-5, "bs {bs} d {d} {isa:?}: {err}");
        }
    }
}

#[test]
fn thread_count_does_not_change_the_result() {
    let c = make_case(7, 9, 3, 64, 16, &[300, 1, 17, 64, 5, 250, 128, 2, 99]);
    for isa in isas() {
        let one = run_case(&c, 1, isa);
        for threads in [0, 2, 3, 7, 64, 1000] {
            assert_eq!(run_case(&c, threads, isa), one, "threads {threads} {isa:?}");
        }
    }
}

#[test]
fn large_scores_do_not_overflow() {
    // scores in the hundreds: a softmax without the running max would overflow e^x
    let mut c = make_case(3, 2, 1, 16, 4, &[37]);
    c.q.iter_mut().for_each(|x| *x *= 100.0);
    let want = reference(&c);
    for isa in isas() {
        let got = run_case(&c, 1, isa);
        assert!(got.iter().all(|x| x.is_finite()));
        assert!(max_abs_diff(&got, &want) < 1e-4);
    }
}

#[test]
fn empty_batch_is_a_no_op() {
    let c = make_case(1, 4, 2, 8, 4, &[]);
    let mut out: Vec<f32> = vec![];
    run(&mut out, &c.q, &c.k, &c.v, &c.tables, &c.lens, c.shape, 4, Isa::Generic).unwrap();
}

#[test]
fn rejects_bad_arguments_without_writing() {
    let base = make_case(11, 4, 2, 8, 4, &[5, 9]);
    let check = |f: &dyn Fn(&mut Case, &mut Vec<f32>), needle: &str| {
        let mut c = make_case(11, 4, 2, 8, 4, &[5, 9]);
        let mut out = vec![7.0f32; c.q.len()];
        f(&mut c, &mut out);
        let err = run(&mut out, &c.q, &c.k, &c.v, &c.tables, &c.lens, c.shape, 2, Isa::Generic).expect_err(needle);
        assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        assert!(out.iter().all(|&x| x == 7.0), "written before failing: {needle}");
    };
    let w = base.shape.block_table_width;
    let num_blocks = (base.k.len() / (4 * 2 * 8)) as i32;
    check(&|c, _| c.shape.num_kv_heads = 3, "multiple of num_kv_heads");
    check(&|c, _| c.shape.head_dim = 0, "must be > 0");
    check(&|c, _| c.shape.block_size = 0, "must be > 0");
    check(&|c, _| c.shape.scale = f32::NAN, "scale");
    check(&|c, _| c.shape.softcap = -1.0, "softcap");
    check(&|c, _| c.shape.softcap = f32::INFINITY, "softcap");
    check(
        &|c, _| {
            c.q.pop();
        },
        "q has",
    );
    check(
        &|_, o| {
            o.pop();
        },
        "out has",
    );
    check(
        &|c, _| {
            c.k.pop();
        },
        "k_cache",
    );
    check(&|c, _| c.v.truncate(c.v.len() - 64), "k_cache");
    check(
        &|c, _| {
            c.tables.pop();
        },
        "block_tables has",
    );
    check(
        &|c, _| {
            c.lens.pop();
        },
        "seq_lens has",
    );
    check(&|c, _| c.lens[1] = 0, "seq_lens[1]");
    check(&|c, _| c.lens[0] = -3, "seq_lens[0]");
    check(&move |c, _| c.lens[0] = (w * 4 + 1) as i32, "seq_lens[0]");
    check(&move |c, _| c.tables[w] = num_blocks, "block id");
    check(&|c, _| c.tables[1] = -1, "block id");
    check(&|c, _| c.shape.num_seqs = usize::MAX / 2, "overflows");
}

#[test]
fn padded_table_entries_beyond_the_length_are_not_read() {
    // an out-of-range id past ceil(len / block_size) is never dereferenced, so it is allowed
    let mut c = make_case(5, 2, 2, 8, 4, &[6]);
    let w = c.shape.block_table_width;
    c.tables[w - 1] = i32::MAX;
    let want = reference(&c);
    assert!(max_abs_diff(&run_case(&c, 1, Isa::Generic), &want) < 1e-5);
}

/// A cache of another element type is read as the f32 values it holds: the kernel on the
/// narrowed cache gives exactly what it gives on an f32 cache of those values (widening is
/// exact, the arithmetic is the f32 path's), on both instruction sets and with a window and a
/// soft cap too.
fn narrow_reads_as_widened<E: crate::KvElem>() {
    for (seed, window, softcap) in [(1, 0, 0.0), (2, 7, 0.0), (3, 0, 0.8)] {
        let mut c = make_case(seed, 9, 3, 64, 16, &[1, 15, 16, 17, 40, 300]);
        c.shape.window = window;
        c.shape.softcap = softcap;
        let (k, v): (Vec<E>, Vec<E>) =
            (c.k.iter().map(|&x| E::narrow(x)).collect(), c.v.iter().map(|&x| E::narrow(x)).collect());
        c.k = k.iter().map(|x| x.to_f32()).collect();
        c.v = v.iter().map(|x| x.to_f32()).collect();
        for isa in isas() {
            let want = run_case(&c, 1, isa);
            for threads in [1, 3] {
                let mut got = vec![f32::NAN; c.q.len()];
                run(&mut got, &c.q, &k, &v, &c.tables, &c.lens, c.shape, threads, isa).unwrap();
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{} {isa:?}", E::NAME);
            }
        }
    }
}

#[test]
fn bf16_and_fp8_caches_read_as_their_f32_values() {
    narrow_reads_as_widened::<crate::Bf16>();
    narrow_reads_as_widened::<crate::Fp8E4M3>();
    narrow_reads_as_widened::<crate::Fp8E5M2>();
}

/// Every row of one call (`shape.num_seqs` of them) gets exactly the bits it gets run alone,
/// on each instruction set and with 1 to 3 threads.
fn rows_compute_as_alone<E: crate::KvElem>(
    q: &[f32],
    k: &[E],
    v: &[E],
    tables: &[i32],
    lens: &[i32],
    shape: DecodeShape,
) {
    let (w, row_len) = (shape.block_table_width, shape.num_heads * shape.head_dim);
    for isa in isas() {
        let alone: Vec<f32> = (0..lens.len())
            .flat_map(|r| {
                let mut one = shape;
                one.num_seqs = 1;
                let mut out = vec![f32::NAN; row_len];
                let (q, t) = (&q[r * row_len..][..row_len], &tables[r * w..][..w]);
                run(&mut out, q, k, v, t, &lens[r..r + 1], one, 1, isa).unwrap();
                out
            })
            .collect();
        for threads in [1, 2, 3] {
            let mut got = vec![f32::NAN; q.len()];
            run(&mut got, q, k, v, tables, lens, shape, threads, isa).unwrap();
            let same = got.iter().zip(&alone).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(same, None, "{} {isa:?} threads {threads} softcap {}", E::NAME, shape.softcap);
        }
    }
}

/// A prompt's tokens as rows of their own (how the engine runs prompt rows): rows of one
/// sequence whose blocks are each a prefix of the next's are computed together, each block read
/// once for all of them (`attend_rows`). Every row must still get exactly the bits it gets
/// alone, on both instruction sets and any thread count, with a soft cap, and on a narrow cache.
fn prompt_rows_compute_as_alone<E: crate::KvElem>() {
    for softcap in [0.0, 0.8] {
        let base = make_case(7, 9, 3, 64, 16, &[76, 30]);
        let w = base.shape.block_table_width;
        let (seq0, seq1) = (&base.tables[..w], &base.tables[w..2 * w]);
        // seq 0's tokens at lengths 41..=76 (across three blocks), one row of seq 1 between,
        // then seq 0 again: shorter rows after a longer one, and a last lone row
        let mut lens: Vec<i32> = (41..=60).collect();
        lens.push(30);
        lens.extend(61..=76);
        lens.extend([10, 11, 12, 5, 76]);
        let tables: Vec<i32> =
            lens.iter().enumerate().flat_map(|(i, _)| if i == 20 { seq1 } else { seq0 }).copied().collect();
        let mut shape = base.shape;
        shape.num_seqs = lens.len();
        shape.softcap = softcap;
        let q = Rng(11).vec(lens.len() * 9 * 64, 2.0);
        let (k, v): (Vec<E>, Vec<E>) =
            (base.k.iter().map(|&x| E::narrow(x)).collect(), base.v.iter().map(|&x| E::narrow(x)).collect());
        rows_compute_as_alone(&q, &k, &v, &tables, &lens, shape);
    }
}

/// Sequences forked from one prompt (or sharing a cached prefix) share their first blocks and
/// part after them; grouped, each still computes as alone.
fn forked_rows_compute_as_alone<E: crate::KvElem>() {
    let lens = [70, 53, 70, 48, 33, 70, 70];
    let base = make_case(5, 9, 3, 64, 16, &lens);
    let w = base.shape.block_table_width;
    let mut tables = base.tables.clone();
    let own = |r: usize, b: usize| base.tables[r * w + b];
    // rows 1..=4 share row 0's first three blocks (row 3 ends there, row 4 holds a part of
    // it); row 2 is row 0 again; row 5 shares one block; row 6 its own
    for r in 1..=4 {
        for b in 0..3.min((lens[r] as usize).div_ceil(16)) {
            tables[r * w + b] = own(0, b);
        }
    }
    for b in 0..5 {
        tables[2 * w + b] = own(0, b);
    }
    tables[5 * w] = own(0, 0);
    let (k, v): (Vec<E>, Vec<E>) =
        (base.k.iter().map(|&x| E::narrow(x)).collect(), base.v.iter().map(|&x| E::narrow(x)).collect());
    let q = Rng(3).vec(lens.len() * 9 * 64, 2.0);
    for softcap in [0.0, 0.8] {
        let mut shape = base.shape;
        shape.softcap = softcap;
        rows_compute_as_alone(&q, &k, &v, &tables, &lens, shape);
    }
}

#[test]
fn forked_rows_read_shared_blocks_once_and_compute_as_alone() {
    forked_rows_compute_as_alone::<f32>();
    forked_rows_compute_as_alone::<crate::Bf16>();
    forked_rows_compute_as_alone::<crate::Fp8E4M3>();
}

#[test]
fn prompt_rows_read_blocks_once_and_compute_as_alone() {
    prompt_rows_compute_as_alone::<f32>();
    prompt_rows_compute_as_alone::<crate::Bf16>();
    prompt_rows_compute_as_alone::<crate::Fp8E4M3>();
}

#[test]
fn avx512_is_about_as_accurate_as_avx2() {
    // The two instruction sets sum a score differently (decode.rs's module doc); neither may
    // drift from the exact result. Mean absolute error against the f64 reference, long rows.
    let (mut errs, mut cases) = (std::collections::HashMap::new(), 0);
    for seed in 0..3 {
        let c = make_case(seed, 9, 3, 64, 16, &[1000, 500, 37, 1500]);
        let want = reference(&c);
        for isa in isas() {
            let got = run_case(&c, 1, isa);
            let err: f64 = got.iter().zip(&want).map(|(a, b)| ((a - b) as f64).abs()).sum::<f64>() / got.len() as f64;
            *errs.entry(format!("{isa:?}")).or_insert(0.0) += err;
        }
        cases += 1;
    }
    let (Some(avx2), Some(avx512)) = (errs.get("Avx2Fma"), errs.get("Avx512")) else {
        eprintln!("no AVX-512F: not compared");
        return;
    };
    assert!(*avx512 < 1.3 * avx2, "mean error over {cases} cases: AVX-512 {avx512:.3e}, AVX2 {avx2:.3e}");
}
