//! Plain loops for CPUs without AVX2: the same integer dot products as `avx2` (exact i32 sums
//! of int8 activations times the block's raw integers), the per-block f32 terms summed in
//! block order.

use super::format::scale_min;
use super::{Pass, QuantType, BLOCK, TOKENS_PER_PASS};

/// acc[j] = dot(token j of the pass, row) for j < pass.n.
pub(super) fn dot_row(ty: QuantType, row: &[u8], pass: &Pass, acc: &mut [f32; TOKENS_PER_PASS]) {
    let bb = ty.block_bytes();
    let cols = pass.nb * BLOCK;
    let mut dots = [0f32; TOKENS_PER_PASS];
    let mut offsets = [0f32; TOKENS_PER_PASS];
    let mut q = [0i16; BLOCK];
    for (b, blk) in row.chunks_exact(bb).enumerate() {
        let (dw, m) = scale_min(ty, blk);
        unpack(ty, blk, &mut q);
        for j in 0..pass.n {
            let xq = &pass.qs[j * cols + b * BLOCK..][..BLOCK];
            // |q * x| <= 128 * 127 and 32 of them: no overflow in i32
            let sumi: i32 = q.iter().zip(xq).map(|(&w, &x)| w as i32 * x as i32).sum();
            dots[j] += (dw * pass.d[pass.at(j, b)]) * sumi as f32;
            if ty != QuantType::Q8_0 {
                offsets[j] += m * pass.s[pass.at(j, b)];
            }
        }
    }
    for j in 0..pass.n {
        acc[j] = dots[j] + offsets[j];
    }
}

/// The block's raw integers (nibbles unsigned, 0..=15).
fn unpack(ty: QuantType, blk: &[u8], q: &mut [i16; BLOCK]) {
    match ty {
        QuantType::Q8_0 => {
            for (o, &v) in q.iter_mut().zip(&blk[2..2 + BLOCK]) {
                *o = (v as i8) as i16;
            }
        }
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let qs = &blk[blk.len() - BLOCK / 2..];
            for i in 0..BLOCK / 2 {
                q[i] = (qs[i] & 0x0f) as i16;
                q[i + BLOCK / 2] = (qs[i] >> 4) as i16;
            }
        }
    }
}
