//! Plain loops for CPUs without AVX2: the `avx2` kernel's operations one lane at a time (the
//! same exact i32 block sums, and the same f32 multiplies and fused multiply-adds in the same
//! order), so both paths give the same bits.

use super::format::{f16_to_f32, QuantType, BLOCK};
use super::pack::{header_bytes, record_bytes, GROUP};
use super::{Lanes, Pass};

/// lanes[j][r] = dot(token j of the pass, row r of the group) for j < pass.n.
pub(super) fn group(ty: QuantType, group: &[u8], pass: &Pass, lanes: &mut Lanes) {
    let (rec_len, head) = (record_bytes(ty), header_bytes(ty));
    let cols = pass.nb * BLOCK;
    for (j, out) in lanes[..pass.n].iter_mut().enumerate() {
        let x = &pass.qs[j * cols..][..cols];
        let mut acc = [0f32; GROUP];
        let mut off = [0f32; GROUP];
        for (b, rec) in group.chunks_exact(rec_len).enumerate() {
            let xb = &x[b * BLOCK..][..BLOCK];
            let (dx, sx) = (pass.d[pass.at(j, b)], pass.s[pass.at(j, b)]);
            for r in 0..GROUP {
                let d = half(rec, 2 * r);
                let sum = dot(ty, &rec[head..], r, xb);
                acc[r] = (sum as f32).mul_add(d * dx, acc[r]);
                let m = match ty {
                    QuantType::Q8_0 => continue,
                    QuantType::Q4_0 => d * -8.0,
                    QuantType::Q4_1 => half(rec, 16 + 2 * r),
                };
                off[r] = m.mul_add(sx, off[r]);
            }
        }
        for r in 0..GROUP {
            out[r] = if ty == QuantType::Q8_0 { acc[r] } else { acc[r] + off[r] };
        }
    }
}

fn half(rec: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([rec[at], rec[at + 1]]))
}

/// Row r's exact integer dot product with the block's int8 activations `xb`, read from the
/// record's integer chunks (`pack`'s layout; Q4 nibbles unsigned, 0..=15).
fn dot(ty: QuantType, ints: &[u8], r: usize, xb: &[i8]) -> i32 {
    let mut sum = 0i32;
    for (c, chunk) in ints.chunks_exact(4 * GROUP).enumerate() {
        for (e, &byte) in chunk[4 * r..][..4].iter().enumerate() {
            sum += match ty {
                QuantType::Q8_0 => (byte as i8) as i32 * xb[4 * c + e] as i32,
                QuantType::Q4_0 | QuantType::Q4_1 => {
                    (byte & 0x0f) as i32 * xb[4 * c + e] as i32 + (byte >> 4) as i32 * xb[16 + 4 * c + e] as i32
                }
            };
        }
    }
    sum
}
