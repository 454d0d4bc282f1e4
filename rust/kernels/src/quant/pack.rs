//! The layout the kernels read: a GGUF matrix's blocks regrouped eight rows at a time.
//!
//! Why: read row by row (GGUF's own order), a block of 32 weights is one row's, so every
//! block's integer dot product ends in 8 partial sums of one row that need a horizontal
//! reduction, and its scale must be broadcast to them; at SmolLM2's 576 columns (18 blocks a
//! row) that per-row and per-block shuffling cost as much as the products. Regrouped, lane r
//! of a vector is row r of the group: one `vpmaddubsw` takes 4 weights of each of 8 rows
//! against 4 activations broadcast to every lane, the group's 8 scales load and convert as one
//! vector, and the 8 results are stored as they are (llama.cpp's "repacked" CPU formats do
//! the same for their own types).
//!
//! Layout: rows are taken in groups of [`GROUP`] (the last group padded with zero rows); a
//! group's blocks are contiguous, block b of group g at record `g * nb + b` (`nb = cols / 32`),
//! each record the same bytes as the group's 8 GGUF blocks, in this order:
//! - the 8 rows' f16 scales `d`, row order (16 bytes);
//! - Q4_1: the 8 rows' f16 mins `m` (16 bytes);
//! - the integers as chunks of 32 bytes: chunk c holds row r's GGUF integer bytes 4c..4c+4 at
//!   bytes 4r..4r+4. A row's Q8_0 block has 32 integer bytes (8 chunks), a Q4 block 16 (4
//!   chunks: byte i holds element i in its low nibble and element i + 16 in its high one, so
//!   chunk c's low nibbles are elements 4c..4c+4 and its high nibbles 16+4c..16+4c+4).
//!
//! So a packed matrix takes `ceil(rows / 8) * 8` rows' GGUF bytes; a padding row is all zero
//! bytes, and its lane is never written to the output.

use super::format::{QuantType, QuantWeights, BLOCK};

/// Rows of a group: one per 32-bit lane of an AVX2 vector.
pub const GROUP: usize = 8;

/// Bytes of the integer chunks of a record (the rest is its f16 header).
fn int_bytes(ty: QuantType) -> usize {
    match ty {
        QuantType::Q8_0 => GROUP * BLOCK,
        QuantType::Q4_0 | QuantType::Q4_1 => GROUP * BLOCK / 2,
    }
}

/// Bytes of one record (the group's 8 blocks of one block column).
pub(super) fn record_bytes(ty: QuantType) -> usize {
    GROUP * ty.block_bytes()
}

/// Bytes of a record's header: the scales, and Q4_1's mins.
pub(super) fn header_bytes(ty: QuantType) -> usize {
    record_bytes(ty) - int_bytes(ty)
}

/// Bytes of `rows x cols` weights of `ty` packed; `cols` must be a positive multiple of 32.
pub fn packed_len(ty: QuantType, rows: usize, cols: usize) -> Result<usize, String> {
    let row_bytes = ty.row_bytes(cols)?;
    rows.div_ceil(GROUP)
        .checked_mul(GROUP * row_bytes)
        .ok_or_else(|| format!("{rows} rows of {row_bytes} bytes overflow"))
}

/// GGUF blocks -> the packed layout (a new buffer of `packed_len` bytes).
pub fn pack(w: &QuantWeights) -> Vec<u8> {
    let (ty, nb) = (w.ty(), w.cols() / BLOCK);
    let (bb, rec, head) = (ty.block_bytes(), record_bytes(ty), header_bytes(ty));
    let ints = bb - head / GROUP; // integer bytes of one row's block
    let mut out = vec![0u8; w.rows().div_ceil(GROUP) * nb * rec];
    for (r, row) in w.data().chunks_exact(w.row_bytes()).enumerate() {
        let (g, lane) = (r / GROUP, r % GROUP);
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            let dst = &mut out[(g * nb + b) * rec..][..rec];
            dst[2 * lane..][..2].copy_from_slice(&blk[..2]);
            if ty == QuantType::Q4_1 {
                dst[16 + 2 * lane..][..2].copy_from_slice(&blk[2..4]);
            }
            for (c, four) in blk[bb - ints..].chunks_exact(4).enumerate() {
                dst[head + 32 * c + 4 * lane..][..4].copy_from_slice(four);
            }
        }
    }
    out
}

/// Row `r` of a packed matrix as its GGUF blocks, into `row` (its row bytes): the inverse of
/// [`pack`] for one row (`dequantize_packed` reads a weight a model keeps only packed).
pub(super) fn unpack_row(w: &PackedWeights, r: usize, row: &mut [u8]) {
    let (ty, nb) = (w.ty(), w.cols() / BLOCK);
    let (bb, rec, head) = (ty.block_bytes(), record_bytes(ty), header_bytes(ty));
    let ints = bb - head / GROUP; // integer bytes of one row's block
    let (g, lane) = (r / GROUP, r % GROUP);
    for (b, blk) in row.chunks_exact_mut(bb).enumerate() {
        let src = &w.data()[(g * nb + b) * rec..][..rec];
        blk[..2].copy_from_slice(&src[2 * lane..][..2]);
        if ty == QuantType::Q4_1 {
            blk[2..4].copy_from_slice(&src[16 + 2 * lane..][..2]);
        }
        for (c, four) in blk[bb - ints..].chunks_exact_mut(4).enumerate() {
            four.copy_from_slice(&src[head + 32 * c + 4 * lane..][..4]);
        }
    }
}

/// A packed matrix (see the module doc), borrowed: `rows x cols` weights of `ty`.
#[derive(Clone, Copy, Debug)]
pub struct PackedWeights<'a> {
    ty: QuantType,
    rows: usize,
    cols: usize,
    data: &'a [u8],
}

impl<'a> PackedWeights<'a> {
    /// Checks that `data` is exactly `packed_len(ty, rows, cols)` bytes.
    pub fn new(ty: QuantType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, String> {
        let expected = packed_len(ty, rows, cols)?;
        if data.len() != expected {
            return Err(format!("packed {ty:?} weights of {rows} x {cols} take {expected} bytes, got {}", data.len()));
        }
        Ok(Self { ty, rows, cols, data })
    }

    pub fn ty(&self) -> QuantType {
        self.ty
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Groups of 8 rows (the last may be part padding).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }
    /// Bytes of one group: its `cols / 32` records.
    pub fn group_bytes(&self) -> usize {
        self.cols / BLOCK * record_bytes(self.ty)
    }
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_land_in_their_lanes_and_padding_is_zero() {
        // 9 rows x 64 cols of Q4_1: byte values say (row, block, offset in block)
        let (rows, cols, bb) = (9, 64, 20);
        let data: Vec<u8> = (0..rows * 2 * bb).map(|i| (i % 251) as u8 + 1).collect();
        let w = QuantWeights::new(QuantType::Q4_1, rows, cols, &data).unwrap();
        let p = pack(&w);
        assert_eq!(p.len(), packed_len(QuantType::Q4_1, rows, cols).unwrap());
        assert_eq!(p.len(), 2 * 8 * 2 * bb);
        let src = |r: usize, b: usize, i: usize| data[r * 2 * bb + b * bb + i];
        // group 0, block 1, row 3: d, m, then integer bytes 4..8 in chunk 1
        let rec = &p[160..320];
        assert_eq!(rec[6..8], [src(3, 1, 0), src(3, 1, 1)]);
        assert_eq!(rec[22..24], [src(3, 1, 2), src(3, 1, 3)]);
        assert_eq!(rec[32 + 32 + 12..][..4], [src(3, 1, 8), src(3, 1, 9), src(3, 1, 10), src(3, 1, 11)]);
        // group 1 holds row 8 in lane 0 and zero padding in lanes 1..8
        let rec = &p[2 * 160..3 * 160];
        assert_eq!(rec[..2], [src(8, 0, 0), src(8, 0, 1)]);
        assert!(rec[2..16].iter().all(|&b| b == 0));
        assert!((0..4).all(|c| rec[32 + 32 * c + 4..32 + 32 * (c + 1)].iter().all(|&b| b == 0)));
        assert!(PackedWeights::new(QuantType::Q4_1, rows, cols, &p).is_ok());
        assert!(PackedWeights::new(QuantType::Q4_1, rows, cols, &p[1..]).is_err());
        assert!(PackedWeights::new(QuantType::Q4_0, rows, cols, &p).is_err());
    }

    #[test]
    fn unpack_gives_back_the_blocks() {
        for (ty, rows) in [(QuantType::Q8_0, 9), (QuantType::Q4_0, 16), (QuantType::Q4_1, 3)] {
            let cols = 96;
            let data: Vec<u8> = (0..rows * ty.row_bytes(cols).unwrap()).map(|i| (i * 7 % 253) as u8).collect();
            let packed = pack(&QuantWeights::new(ty, rows, cols, &data).unwrap());
            let view = PackedWeights::new(ty, rows, cols, &packed).unwrap();
            let row_bytes = ty.row_bytes(cols).unwrap();
            let mut unpacked = vec![0u8; rows * row_bytes];
            for (r, row) in unpacked.chunks_exact_mut(row_bytes).enumerate() {
                unpack_row(&view, r, row);
            }
            assert_eq!(unpacked, data, "{ty:?}");
            let mut want = vec![0f32; rows * cols];
            for (row, o) in data.chunks_exact(ty.row_bytes(cols).unwrap()).zip(want.chunks_exact_mut(cols)) {
                crate::quant::dequantize_row(ty, row, o).unwrap();
            }
            for threads in [1, 2, 5] {
                let mut got = vec![0f32; rows * cols];
                crate::quant::dequantize_packed(&view, &mut got, threads).unwrap();
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{ty:?} {threads}"
                );
            }
        }
    }
}
