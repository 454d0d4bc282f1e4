//! `decoder_layer` against a naive reference: f64 norms, RoPE, SiLU and softmax attention over
//! the sequences' gathered context, with the linears through `quant_matmul` (its own tests
//! check it against dequantize-then-matmul). Llama, Qwen2 (qkv bias), Qwen3 (q/k norms) and
//! SmolLM3 NoPE (no RoPE) variants, mixed context lengths, two thread counts, and the argument checks.

use super::*;
use crate::quant::{pack, QuantType, QuantWeights};
use crate::tests::Rng;

/// Random Q8_0 weights (scale 2^-6, exact in f16: 0x2400), packed for the kernel.
fn q8_0(rng: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
    let mut gguf = Vec::new();
    for _ in 0..rows * cols / 32 {
        gguf.extend_from_slice(&0x2400u16.to_le_bytes());
        gguf.extend((0..32).map(|_| (rng.next() % 255) as u8));
    }
    pack(&QuantWeights::new(QuantType::Q8_0, rows, cols, &gguf).unwrap())
}

struct Model {
    s: LayerShape,
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    qkv: Vec<u8>,
    qkv_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    rope: bool,
    o_proj: Vec<u8>,
    gate_up: Vec<u8>,
    down: Vec<u8>,
}

const SHAPE: LayerShape = LayerShape {
    hidden: 64,
    num_heads: 4,
    num_kv_heads: 2,
    head_dim: 16,
    intermediate: 96,
    eps: 1e-5,
    block_size: 4,
    scale: 0.25,
};

fn model(seed: u64, bias: bool, qk_norm: bool) -> Model {
    let mut rng = Rng(seed | 1);
    let s = SHAPE;
    let width = s.qkv_width();
    let mut norm = |n: usize| (0..n).map(|_| 1.0 + 0.2 * rng.f32()).collect::<Vec<f32>>();
    let (input_norm, post_norm) = (norm(s.hidden), norm(s.hidden));
    let (q_norm, k_norm) = if qk_norm { (Some(norm(s.head_dim)), Some(norm(s.head_dim))) } else { (None, None) };
    Model {
        input_norm,
        post_norm,
        q_norm,
        k_norm,
        rope: true,
        qkv: q8_0(&mut rng, width, s.hidden),
        qkv_bias: bias.then(|| rng.vec(width, 0.5)),
        o_proj: q8_0(&mut rng, s.hidden, s.num_heads * s.head_dim),
        gate_up: q8_0(&mut rng, 2 * s.intermediate, s.hidden),
        down: q8_0(&mut rng, s.hidden, s.intermediate),
        s,
    }
}

fn q(data: &[u8], rows: usize, cols: usize) -> PackedWeights<'_> {
    PackedWeights::new(QuantType::Q8_0, rows, cols, data).unwrap()
}

impl Model {
    fn weights(&self) -> LayerWeights<'_> {
        let s = &self.s;
        LayerWeights {
            input_norm: &self.input_norm,
            post_norm: &self.post_norm,
            qkv: q(&self.qkv, s.qkv_width(), s.hidden),
            qkv_bias: self.qkv_bias.as_deref(),
            q_norm: self.q_norm.as_deref(),
            k_norm: self.k_norm.as_deref(),
            rope: self.rope,
            o_proj: q(&self.o_proj, s.hidden, s.num_heads * s.head_dim),
            o_bias: None,
            gate_up: q(&self.gate_up, 2 * s.intermediate, s.hidden),
            down: q(&self.down, s.hidden, s.intermediate),
        }
    }
}

struct Step {
    h: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    slots: Vec<i64>,
    tables: Vec<i32>,
    lens: Vec<i32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Sequences of `lens` tokens (this step's token last), blocks in a shuffled order, earlier
/// tokens' K/V random.
fn step(seed: u64, lens: &[i32]) -> Step {
    let s = SHAPE;
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let bs = s.block_size;
    let width = lens.iter().map(|&l| (l as usize).div_ceil(bs)).max().unwrap() + 1;
    let num_blocks = lens.iter().map(|&l| (l as usize).div_ceil(bs)).sum::<usize>() + 2;
    let mut ids: Vec<i32> = (1..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.next() as usize % (i + 1));
    }
    let mut tables = vec![0; lens.len() * width];
    let mut next = ids.into_iter();
    let mut slots = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let len = len as usize;
        for b in 0..len.div_ceil(bs) {
            tables[i * width + b] = next.next().unwrap();
        }
        slots.push(tables[i * width + (len - 1) / bs] as i64 * bs as i64 + ((len - 1) % bs) as i64);
    }
    let t = lens.len();
    let half = s.head_dim / 2;
    let angles: Vec<f32> =
        (0..t * half).map(|i| (lens[i / half] as f32 - 1.0) * 0.3f32.powi((i % half) as i32)).collect();
    let cache = num_blocks * bs * s.num_kv_heads * s.head_dim;
    Step {
        h: rng.vec(t * s.hidden, 1.0),
        cos: angles.iter().map(|a| a.cos()).collect(),
        sin: angles.iter().map(|a| a.sin()).collect(),
        slots,
        tables,
        lens: lens.to_vec(),
        k: rng.vec(cache, 1.0),
        v: rng.vec(cache, 1.0),
    }
}

fn matmul(x: &[f32], tokens: usize, w: &PackedWeights) -> Vec<f32> {
    let mut out = vec![0.0; tokens * w.rows()];
    quant_matmul(&mut out, x, tokens, w, 1).unwrap();
    out
}

fn norm_ref(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(&v, &g)| (v as f64 * inv) as f32 * g).collect()
}

/// The layer written out plainly, one token at a time.
fn reference(m: &Model, st: &mut Step) -> Vec<f32> {
    reference_rounding(m, st, |x| x)
}

/// `reference` with a cache that keeps each written value as `round` makes it.
fn reference_rounding(m: &Model, st: &mut Step, round: impl Fn(f32) -> f32) -> Vec<f32> {
    let s = m.s;
    let w = m.weights();
    let (hd, d, nh, nkv) = (s.hidden, s.head_dim, s.num_heads, s.num_kv_heads);
    let half = d / 2;
    let t_count = st.lens.len();
    let width = st.tables.len() / t_count;
    let mut h = st.h.clone();
    for t in 0..t_count {
        let ht = &mut h[t * hd..][..hd];
        let x = norm_ref(ht, &m.input_norm, s.eps);
        let mut qkv = matmul(&x, 1, &w.qkv);
        if let Some(b) = &m.qkv_bias {
            qkv.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        }
        let mut heads: Vec<Vec<f32>> = qkv.chunks(d).map(<[f32]>::to_vec).collect();
        for (j, head) in heads.iter_mut().enumerate().take(nh + nkv) {
            if let Some(n) = if j < nh { &m.q_norm } else { &m.k_norm } {
                *head = norm_ref(head, n, s.eps);
            }
            if !m.rope {
                continue;
            }
            let rot: Vec<f32> = (0..d)
                .map(|i| {
                    let (c, sn) = (st.cos[t * half + i % half], st.sin[t * half + i % half]);
                    if i < half {
                        head[i] * c - head[i + half] * sn
                    } else {
                        head[i] * c + head[i - half] * sn
                    }
                })
                .collect();
            *head = rot;
        }
        let slot = st.slots[t] as usize;
        for j in 0..nkv {
            let (k, v) = (&heads[nh + j], &heads[nh + nkv + j]);
            st.k[(slot * nkv + j) * d..][..d].iter_mut().zip(k).for_each(|(c, &x)| *c = round(x));
            st.v[(slot * nkv + j) * d..][..d].iter_mut().zip(v).for_each(|(c, &x)| *c = round(x));
        }
        let len = st.lens[t] as usize;
        let mut attn = vec![0f32; nh * d];
        for qh in 0..nh {
            let kvh = qh / (nh / nkv);
            let at = |p: usize| {
                let block = st.tables[t * width + p / s.block_size] as usize;
                ((block * s.block_size + p % s.block_size) * nkv + kvh) * d
            };
            let scores: Vec<f64> = (0..len)
                .map(|p| (0..d).map(|i| heads[qh][i] as f64 * st.k[at(p) + i] as f64).sum::<f64>() * s.scale as f64)
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..d {
                attn[qh * d + i] = ((0..len).map(|p| e[p] * st.v[at(p) + i] as f64).sum::<f64>() / z) as f32;
            }
        }
        let o = matmul(&attn, 1, &w.o_proj);
        ht.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let x = norm_ref(ht, &m.post_norm, s.eps);
        let gu = matmul(&x, 1, &w.gate_up);
        let act: Vec<f32> = (0..s.intermediate)
            .map(|i| {
                let g = gu[i] as f64;
                (g / (1.0 + (-g).exp()) * gu[s.intermediate + i] as f64) as f32
            })
            .collect();
        let dn = matmul(&act, 1, &w.down);
        ht.iter_mut().zip(&dn).for_each(|(a, b)| *a += b);
    }
    h
}

fn run(m: &Model, st: &mut Step, threads: usize) -> Result<(), String> {
    let tokens = st.lens.len();
    let step =
        DecodeTokens { cos: &st.cos, sin: &st.sin, slots: &st.slots, block_tables: &st.tables, seq_lens: &st.lens };
    decoder_layer(&mut st.h, tokens, &m.weights(), &m.s, &step, &mut st.k, &mut st.v, &mut Scratch::default(), threads)
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn matches_the_reference_for_each_family() {
    for (seed, bias, qk_norm, rope) in
        [(1, false, false, true), (2, true, false, true), (3, false, true, true), (5, false, false, false)]
    {
        let m = Model { rope, ..model(seed, bias, qk_norm) };
        let lens = [1, 6, 13];
        let mut want = step(seed, &lens);
        let expect_h = reference(&m, &mut want);
        for threads in [1, 3] {
            let mut got = step(seed, &lens);
            run(&m, &mut got, threads).unwrap();
            assert!(
                max_rel(&got.h, &expect_h) < 1e-4,
                "h, bias {bias} qk_norm {qk_norm} rope {rope}: {}",
                max_rel(&got.h, &expect_h)
            );
            assert!(max_rel(&got.k, &want.k) < 1e-5 && max_rel(&got.v, &want.v) < 1e-5, "caches");
        }
    }
}

#[test]
fn thread_count_does_not_change_bits() {
    let m = model(4, true, true);
    let (mut a, mut b) = (step(9, &[3, 8, 17, 2]), step(9, &[3, 8, 17, 2]));
    run(&m, &mut a, 1).unwrap();
    run(&m, &mut b, 4).unwrap();
    assert_eq!(a.h, b.h);
    assert_eq!(a.k, b.k);
}

#[test]
fn bad_arguments_write_nothing() {
    let m = model(5, false, false);
    type Edit = fn(&mut Step);
    let cases: [(Edit, &str); 5] = [
        (|s| s.slots[1] = 10_000, "slot"),
        (|s| s.tables[0] = 999, "block id"),
        (|s| s.lens[0] = 0, "seq_lens"),
        (|s| s.cos.pop().map(drop).unwrap_or(()), "cos"),
        (|s| s.k.truncate(s.k.len() - 1), "k_cache"),
    ];
    for (edit, needle) in cases {
        let mut st = step(5, &[2, 5]);
        edit(&mut st);
        let (k_before, h_before) = (st.k.clone(), st.h.clone());
        let err = run(&m, &mut st, 2).unwrap_err();
        assert!(err.contains(needle), "{needle}: {err}");
        assert_eq!(st.h, h_before);
        assert_eq!(st.k, k_before);
    }
}

/// FNV-1a over the bits of `values`.
fn bits_hash(values: &[f32]) -> u64 {
    values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

#[test]
fn numerics_revision_pins_the_layer_bits() {
    // As tests/quant.rs pins the quantized GEMV: a whole layer (norms, the GEMVs, RoPE, the KV
    // write, paged attention, SiLU) must give these bits at this NUMERICS_REVISION; a change
    // that moves them bumps it (rust/kernels/src/lib.rs) and pins the new hash in the same
    // commit. Attention's bits depend on the instruction set: each x86-64 path this CPU has is
    // pinned (every machine that runs llmserve's CI has AVX2+FMA; AVX-512 where it has that).
    use crate::decode::{Isa, FORCED_ISA};
    const PINNED: u32 = 5;
    let pins = [
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2Fma, 0xceea_9de2_548d_669fu64),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, 0x824c_b09f_e43b_10ea),
    ];
    let supported = Isa::supported();
    for (isa, pinned) in pins.into_iter().filter(|(isa, _)| supported.contains(isa)) {
        let m = model(6, true, true);
        let mut st = step(6, &[1, 6, 13, 40]);
        FORCED_ISA.set(Some(isa));
        let ran = run(&m, &mut st, 2);
        FORCED_ISA.set(None);
        ran.unwrap();
        let got = bits_hash(&st.h) ^ bits_hash(&st.k).rotate_left(1) ^ bits_hash(&st.v).rotate_left(2);
        assert_eq!(
            (crate::NUMERICS_REVISION, got),
            (PINNED, pinned),
            "the decoder layer's bits on {isa:?} changed: bump NUMERICS_REVISION and pin the new hash {got:#x}"
        );
    }
    if !supported.iter().any(|isa| pins.iter().any(|(p, _)| p == isa)) {
        eprintln!("no AVX2+FMA: the pinned bits are those of the x86-64 paths; not checked");
    }
}

/// With a bfloat16 or fp8 cache, the layer writes each new K/V value narrowed, and attends over
/// the narrowed cache: as the reference does with a cache that rounds what it keeps.
fn narrow_cache_layer<E: KvElem + PartialEq + std::fmt::Debug>() {
    let m = model(7, false, true);
    let lens = [1, 6, 13];
    let round = |x: &[f32]| x.iter().map(|&x| E::narrow(x).to_f32()).collect::<Vec<f32>>();
    let mut want = step(7, &lens);
    (want.k, want.v) = (round(&want.k), round(&want.v));
    let expect_h = reference_rounding(&m, &mut want, |x| E::narrow(x).to_f32());
    let mut st = step(7, &lens);
    let narrow = |x: &[f32]| x.iter().map(|&x| E::narrow(x)).collect::<Vec<E>>();
    let (mut k, mut v) = (narrow(&st.k), narrow(&st.v));
    let step =
        DecodeTokens { cos: &st.cos, sin: &st.sin, slots: &st.slots, block_tables: &st.tables, seq_lens: &st.lens };
    decoder_layer(&mut st.h, lens.len(), &m.weights(), &m.s, &step, &mut k, &mut v, &mut Scratch::default(), 2)
        .unwrap();
    assert_eq!(k, narrow(&want.k), "{}", E::NAME);
    assert_eq!(v, narrow(&want.v), "{}", E::NAME);
    let err = max_rel(&st.h, &expect_h);
    assert!(err < 1e-4, "{}: {err}", E::NAME);
}

#[test]
fn narrow_caches_are_written_rounded() {
    narrow_cache_layer::<crate::Bf16>();
    narrow_cache_layer::<crate::Fp8E4M3>();
    narrow_cache_layer::<crate::Fp8E5M2>();
}
