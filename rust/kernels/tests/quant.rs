//! Tests of `llmserve_kernels::quant`: every format and instruction set against
//! dequantize-then-matmul in f64 with x rounded to int8 blocks the way the kernel promises
//! (tight), and with x as it is (within the bound that rounding allows); hand-decoded blocks,
//! batch and thread invariance, non-finite input, shape errors, and a property test over
//! random shapes, token counts and thread counts.

use llmserve_kernels::quant::{
    dequantize_row, f16_to_f32, pack, packed_len, quant_matmul, quant_matmul_with, Isa, PackedWeights, QuantType,
    QuantWeights,
};
use llmserve_kernels::NUMERICS_REVISION;
use proptest::prelude::*;

const TYPES: [QuantType; 3] = [QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_1];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*: enough randomness for test data, no dependency
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    /// A finite f16 of magnitude about 2^-6 .. 2^1, either sign.
    fn f16(&mut self) -> [u8; 2] {
        let r = self.next();
        let exp = 9 + (r % 8) as u16;
        let bits = ((r >> 8) as u16 & 0x8000) | (exp << 10) | ((r >> 20) as u16 & 0x3ff);
        bits.to_le_bytes()
    }
}

fn random_weights(rng: &mut Rng, ty: QuantType, rows: usize, cols: usize) -> Vec<u8> {
    let mut data = Vec::new();
    for _ in 0..rows * cols / 32 {
        data.extend(rng.f16());
        if ty == QuantType::Q4_1 {
            data.extend(rng.f16());
        }
        let n = if ty == QuantType::Q8_0 { 32 } else { 16 };
        data.extend((0..n).map(|_| rng.next() as u8));
    }
    data
}

/// x rounded as the kernel's contract says (module doc of `quant`): per block of 32,
/// d = max|x| / 127 and q = round_half_even(x * (127 / max|x|)), in f32 arithmetic. Returns
/// the rounded values d * q and each value's block scale d.
fn quantize_x(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut xq, mut scales) = (Vec::with_capacity(x.len()), Vec::with_capacity(x.len()));
    for blk in x.chunks_exact(32) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for &v in blk {
            let q = (v * id).round_ties_even();
            assert!(q.abs() <= 127.0);
            xq.push(d * q);
            scales.push(d);
        }
    }
    (xq, scales)
}

struct Reference {
    /// dequantized w times the int8-rounded x, in f64: what the kernel computes up to f32
    /// rounding of its per-block terms
    exact: Vec<f64>,
    /// sum |w| |x_rounded|: the scale of that f32 rounding
    mag: Vec<f64>,
    /// dequantized w times x itself (the fp32 matmul's answer, in f64)
    fp: Vec<f64>,
    /// sum |w| * d / 2: the most the activations' rounding can move a result (|x - d q| <= d / 2)
    rounding: Vec<f64>,
}

fn reference(ty: QuantType, data: &[u8], x: &[f32], tokens: usize, rows: usize, cols: usize) -> Reference {
    let rb = ty.row_bytes(cols).unwrap();
    let mut w = vec![0f32; rows * cols];
    for (row, o) in data.chunks_exact(rb).zip(w.chunks_exact_mut(cols)) {
        dequantize_row(ty, row, o).unwrap();
    }
    let (xq, scales) = quantize_x(x);
    let n = tokens * rows;
    let mut r = Reference { exact: vec![0.0; n], mag: vec![0.0; n], fp: vec![0.0; n], rounding: vec![0.0; n] };
    for t in 0..tokens {
        for row in 0..rows {
            let o = t * rows + row;
            for k in 0..cols {
                let (wk, i) = (w[row * cols + k] as f64, t * cols + k);
                r.exact[o] += xq[i] as f64 * wk;
                r.mag[o] += (xq[i] as f64 * wk).abs();
                r.fp[o] += x[i] as f64 * wk;
                r.rounding[o] += wk.abs() * scales[i] as f64 * 0.5;
            }
        }
    }
    r
}

fn isas() -> Vec<Isa> {
    Isa::supported().to_vec()
}

fn run(ty: QuantType, data: &[u8], x: &[f32], tokens: usize, rows: usize, threads: usize, isa: Isa) -> Vec<f32> {
    let cols = x.len() / tokens.max(1);
    let packed = pack(&QuantWeights::new(ty, rows, cols, data).unwrap());
    let w = PackedWeights::new(ty, rows, cols, &packed).unwrap();
    let mut out = vec![f32::NAN; tokens * rows];
    quant_matmul_with(&mut out, x, tokens, &w, threads, isa).unwrap();
    out
}

#[allow(clippy::too_many_arguments)]
fn check(seed: u64, ty: QuantType, tokens: usize, rows: usize, cols: usize, threads: usize, isa: Isa) -> Vec<f32> {
    let mut rng = Rng(seed | 1);
    let data = random_weights(&mut rng, ty, rows, cols);
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.f32()).collect();
    let out = run(ty, &data, &x, tokens, rows, threads, isa);
    let r = reference(ty, &data, &x, tokens, rows, cols);
    for (i, &got) in out.iter().enumerate() {
        let at = format!("{ty:?} {isa:?} T={tokens} R={rows} K={cols} threads={threads}: [{}, {}]", i / rows, i % rows);
        // tight: the same int8 activations, only f32 rounding apart
        let err = (got as f64 - r.exact[i]).abs();
        assert!(err <= 1e-5 * r.mag[i] + 1e-6, "{at} = {got} want {} (err {err:e})", r.exact[i]);
        // loose: the fp32 answer, within what rounding x to int8 can cost
        let err = (got as f64 - r.fp[i]).abs();
        assert!(err <= r.rounding[i] + 1e-5 * r.mag[i] + 1e-6, "{at} vs fp: err {err:e} > {:e}", r.rounding[i]);
    }
    out
}

#[test]
fn every_format_matches_dequantize_then_matmul() {
    for ty in TYPES {
        for isa in isas() {
            for tokens in 1..=4 {
                for (rows, cols) in [(1, 32), (7, 64), (33, 96), (129, 576)] {
                    check(rows as u64 * 31 + tokens as u64, ty, tokens, rows, cols, 1, isa);
                }
            }
        }
    }
}

#[test]
fn many_tokens_take_several_passes() {
    for ty in TYPES {
        for isa in isas() {
            for tokens in [5, 8, 9] {
                check(tokens as u64, ty, tokens, 11, 160, 2, isa);
            }
        }
    }
}

#[test]
fn threads_do_not_change_results() {
    // Each row is computed whole by one thread, so the bits are the same for any split.
    for ty in TYPES {
        let one = check(7, ty, 3, 4099, 64, 1, Isa::detect());
        for threads in [2, 3, 8] {
            assert_eq!(one, check(7, ty, 3, 4099, 64, threads, Isa::detect()), "{ty:?} x{threads}");
        }
    }
}

#[test]
fn hand_decoded_blocks() {
    // d = 0.5 (0x3800), m = -1.0 (0xbc00)
    let mut q8 = vec![0x00, 0x38];
    q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
    let mut out = [0f32; 32];
    dequantize_row(QuantType::Q8_0, &q8, &mut out).unwrap();
    assert_eq!(out[0], -8.0);
    assert_eq!(out[31], 7.5);

    // byte i = (hi << 4) | lo with lo = i, hi = 15 - i: element i is i, element i + 16 is 15 - i
    let nibbles: Vec<u8> = (0..16u8).map(|i| ((15 - i) << 4) | i).collect();
    let q4_0: Vec<u8> = [0x00, 0x38].into_iter().chain(nibbles.iter().copied()).collect();
    dequantize_row(QuantType::Q4_0, &q4_0, &mut out).unwrap();
    assert_eq!((out[0], out[15], out[16], out[31]), (-4.0, 3.5, 3.5, -4.0));

    let q4_1: Vec<u8> = [0x00, 0x38, 0x00, 0xbc].into_iter().chain(nibbles).collect();
    dequantize_row(QuantType::Q4_1, &q4_1, &mut out).unwrap();
    assert_eq!((out[0], out[15], out[16], out[31]), (-1.0, 6.5, 6.5, -1.0));

    // and the kernel agrees on a one-hot x of 127 (exactly an int8 block: d = 1, q = 127)
    for (ty, blk, want) in [(QuantType::Q4_1, &q4_1, -1.0), (QuantType::Q4_0, &q4_0, -4.0), (QuantType::Q8_0, &q8, 7.5)]
    {
        let packed = pack(&QuantWeights::new(ty, 1, 32, blk).unwrap());
        let w = PackedWeights::new(ty, 1, 32, &packed).unwrap();
        for isa in isas() {
            let mut x = [0f32; 32];
            x[31] = 127.0;
            let mut y = [0f32; 1];
            quant_matmul_with(&mut y, &x, 1, &w, 1, isa).unwrap();
            assert_eq!(y[0], want * 127.0, "{ty:?} {isa:?}");
        }
    }
}

#[test]
fn extreme_integers_do_not_saturate() {
    // The largest products the i16 steps see: every nibble 15 (or every Q8_0 weight -128)
    // against activations of +127 (token 0) and -127 (token 1). Scales are 1 (0x3c00) and
    // Q4_1's min -1 (0xbc00), so every term and the result are exact in f32.
    for ty in TYPES {
        let (rows, cols) = (9, 64);
        let mut data = Vec::new();
        for _ in 0..rows * cols / 32 {
            data.extend(0x3c00u16.to_le_bytes());
            if ty == QuantType::Q4_1 {
                data.extend(0xbc00u16.to_le_bytes());
            }
            let (byte, n) = if ty == QuantType::Q8_0 { (0x80, 32) } else { (0xff, 16) };
            data.extend(std::iter::repeat_n(byte, n));
        }
        let x: Vec<f32> = (0..2 * cols).map(|i| if i < cols { 127.0 } else { -127.0 }).collect();
        let w = match ty {
            QuantType::Q8_0 => -128.0,
            QuantType::Q4_0 => 15.0 - 8.0,
            QuantType::Q4_1 => 15.0 - 1.0,
        };
        for isa in isas() {
            let out = run(ty, &data, &x, 2, rows, 1, isa);
            let want: Vec<f32> = [1.0, -1.0].iter().flat_map(|s| vec![s * w * 127.0 * cols as f32; rows]).collect();
            assert_eq!(out, want, "{ty:?} {isa:?}");
        }
    }
}

#[test]
fn a_row_does_not_depend_on_the_other_tokens() {
    // Each token is quantized alone and its dot products run the same operations whatever
    // the pass holds (--batch-invariant relies on it).
    for ty in TYPES {
        let mut rng = Rng(99);
        let (rows, cols) = (37, 192);
        let data = random_weights(&mut rng, ty, rows, cols);
        let x: Vec<f32> = (0..9 * cols).map(|_| rng.f32()).collect();
        for isa in isas() {
            let all = run(ty, &data, &x, 9, rows, 2, isa);
            for t in 1..9 {
                let part = run(ty, &data, &x[(9 - t) * cols..], t, rows, 1, isa);
                assert_eq!(part, all[(9 - t) * rows..], "{ty:?} {isa:?} last {t}");
            }
        }
    }
}

#[test]
fn isas_give_the_same_bits() {
    // The portable path does the AVX2 kernel's operations in the same order (module doc),
    // whatever the weights' scales hold: blocks with a zero, subnormal, infinite or NaN scale
    // (and Q4_1 min) are mixed in, and the matrix is big enough to split over 2 threads.
    let specials: [u16; 5] = [0x0000, 0x0001, 0x7c00, 0xfc00, 0x7e00];
    for ty in TYPES {
        let mut rng = Rng(5);
        let (rows, cols) = (1031, 576);
        let mut data = random_weights(&mut rng, ty, rows, cols);
        let bb = ty.block_bytes();
        for (i, half) in specials.iter().enumerate() {
            let at = (100 * i + 7) * (cols / 32) * bb + 3 * bb; // row 100 i + 7, block 3
            data[at..at + 2].copy_from_slice(&half.to_le_bytes());
            if ty == QuantType::Q4_1 {
                data[at + bb + 2..at + bb + 4].copy_from_slice(&half.to_le_bytes());
                // block 4's min
            }
        }
        let x: Vec<f32> = (0..6 * cols).map(|_| rng.f32() * 4.0).collect();
        let want = run(ty, &data, &x, 6, rows, 1, Isa::Portable);
        assert!(want.iter().any(|v| v.is_nan()) && want.iter().any(|v| v.is_infinite()), "{ty:?}");
        for isa in isas() {
            let got = run(ty, &data, &x, 6, rows, 2, isa);
            // NaN payloads may differ between scalar and vector arithmetic; NaN-ness may not
            let same = |a: &f32, b: &f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            assert!(want.iter().zip(&got).all(|(a, b)| same(a, b)), "{ty:?} {isa:?}");
        }
    }
}

/// FNV-1a over the outputs' bits: a fingerprint of the kernel's exact results.
fn bits_hash(out: &[f32]) -> u64 {
    out.iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

#[test]
fn numerics_revision_pins_the_bits() {
    // What `system_fingerprint` promises: the same revision, the same output bits. A change
    // that moves them must bump NUMERICS_REVISION (rust/kernels/src/lib.rs) and record the new
    // hashes here, in the same commit. (A bump for another reason keeps the hashes.)
    const PINNED: (u32, [u64; 3]) = (5, [0x3014_afe7_a6b9_7079, 0x29db_5f45_795a_4cc9, 0x17c6_5d74_0207_ec85]);
    let mut got = [0u64; 3];
    for (i, ty) in TYPES.into_iter().enumerate() {
        let mut rng = Rng(11);
        let (rows, cols) = (75, 576);
        let data = random_weights(&mut rng, ty, rows, cols);
        let x: Vec<f32> = (0..5 * cols).map(|_| rng.f32() * 3.0).collect();
        got[i] = bits_hash(&run(ty, &data, &x, 5, rows, 1, Isa::Portable));
        for isa in isas() {
            assert_eq!(bits_hash(&run(ty, &data, &x, 5, rows, 2, isa)), got[i], "{ty:?} {isa:?}");
        }
    }
    assert_eq!(
        (NUMERICS_REVISION, got),
        PINNED,
        "the quantized GEMV's bits changed: bump NUMERICS_REVISION and pin the new hashes {got:#x?}"
    );
}

#[test]
fn non_finite_activations_poison_only_their_token() {
    for ty in TYPES {
        let mut rng = Rng(3);
        let data = random_weights(&mut rng, ty, 5, 64);
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x: Vec<f32> = (0..3 * 64).map(|_| rng.f32()).collect();
            x[64 + 40] = bad; // token 1, second block
            for isa in isas() {
                let out = run(ty, &data, &x, 3, 5, 1, isa);
                assert!(out[5..10].iter().all(|v| v.is_nan()), "{ty:?} {isa:?} {bad}");
                assert!(out[..5].iter().chain(&out[10..]).all(|v| v.is_finite()), "{ty:?} {isa:?}");
            }
        }
    }
}

#[test]
fn f16_conversion_covers_special_values() {
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0xc000), -2.0);
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
    assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    assert!(f16_to_f32(0x7e00).is_nan());
}

#[test]
fn bad_shapes_are_errors() {
    let data = vec![0u8; 2 * 20];
    assert!(QuantWeights::new(QuantType::Q4_1, 2, 48, &data).is_err()); // cols not a multiple of 32
    assert!(QuantWeights::new(QuantType::Q4_1, 3, 32, &data).is_err()); // too few bytes
    assert!(QuantWeights::new(QuantType::Q4_0, 2, 32, &data).is_err()); // wrong block size
    assert!(QuantWeights::new(QuantType::Q4_1, 2, 0, &data).is_err());
    let packed = pack(&QuantWeights::new(QuantType::Q4_1, 2, 32, &data).unwrap());
    assert_eq!(packed.len(), packed_len(QuantType::Q4_1, 2, 32).unwrap()); // 8 rows' bytes
    assert!(PackedWeights::new(QuantType::Q4_1, 2, 32, &data).is_err()); // GGUF bytes, not packed
    let w = PackedWeights::new(QuantType::Q4_1, 2, 32, &packed).unwrap();
    let x = vec![0f32; 64];
    let mut out = vec![0f32; 4];
    assert!(quant_matmul(&mut out, &x[..63], 2, &w, 1).is_err());
    assert!(quant_matmul(&mut out[..3], &x, 2, &w, 1).is_err());
    assert!(quant_matmul(&mut out, &x, 2, &w, 0).is_err());
    assert!(quant_matmul(&mut out, &x, usize::MAX, &w, 1).is_err());
    quant_matmul(&mut out, &x, 2, &w, 1).unwrap();
    assert!(quant_matmul(&mut [], &[], 0, &w, 1).is_ok());
    assert_eq!(QuantType::from_ggml(3), Some(QuantType::Q4_1));
    assert_eq!(QuantType::from_ggml(1), None); // F16 is not a block format here
    for ty in TYPES {
        assert_eq!(QuantType::from_ggml(ty.ggml_id()), Some(ty));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn prop_matches_reference(
        seed in any::<u64>(), ty in 0usize..3, tokens in 1usize..10, rows in 1usize..70,
        blocks in 1usize..6, threads in 1usize..5, portable in any::<bool>(),
    ) {
        let isa = if portable { Isa::Portable } else { Isa::detect() };
        check(seed, TYPES[ty], tokens, rows, blocks * 32, threads, isa);
    }
}
