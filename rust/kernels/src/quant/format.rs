//! The GGUF block formats this kernel reads: their sizes, a checked view of a matrix of
//! blocks, and the reference dequantization (the tests' ground truth).

/// Weights per block in every format here.
pub const BLOCK: usize = 32;

/// A GGUF block format this module reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantType {
    Q8_0,
    Q4_0,
    Q4_1,
}

impl QuantType {
    /// From ggml's type id (`GGMLQuantizationType`): Q4_0 = 2, Q4_1 = 3, Q8_0 = 8.
    pub fn from_ggml(id: u32) -> Option<Self> {
        match id {
            2 => Some(Self::Q4_0),
            3 => Some(Self::Q4_1),
            8 => Some(Self::Q8_0),
            _ => None,
        }
    }

    pub fn ggml_id(self) -> u32 {
        match self {
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
        }
    }

    /// Bytes of one block of 32 weights.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
        }
    }

    /// Bytes of one row of `cols` weights; `cols` must be a positive multiple of 32.
    pub fn row_bytes(self, cols: usize) -> Result<usize, String> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(format!("cols must be a positive multiple of {BLOCK}, got {cols}"));
        }
        Ok(cols / BLOCK * self.block_bytes())
    }
}

/// A row-major matrix of quantized blocks: `rows` rows of `cols / 32` blocks each.
#[derive(Clone, Copy, Debug)]
pub struct QuantWeights<'a> {
    ty: QuantType,
    rows: usize,
    cols: usize,
    data: &'a [u8],
}

impl<'a> QuantWeights<'a> {
    /// Checks that `data` holds exactly `rows` rows of `cols` weights of type `ty`.
    pub fn new(ty: QuantType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, String> {
        let row_bytes = ty.row_bytes(cols)?;
        let expected =
            rows.checked_mul(row_bytes).ok_or_else(|| format!("{rows} rows of {row_bytes} bytes overflow"))?;
        if data.len() != expected {
            return Err(format!("{ty:?} weights of {rows} x {cols} take {expected} bytes, got {}", data.len()));
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
    pub fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.ty.block_bytes()
    }
    /// The raw blocks, `rows * row_bytes()` bytes.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
}

/// IEEE half -> single, exact for every value (subnormals, infinities, NaN included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        0 if man == 0 => sign,
        0 => {
            // subnormal: man * 2^-24, exact in f32
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        31 => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

pub(super) fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// Dequantizes one row of blocks into `out` (`out.len()` = 32 x blocks): the reference the
/// tests compare against, written straight from the format definitions.
pub fn dequantize_row(ty: QuantType, row: &[u8], out: &mut [f32]) -> Result<(), String> {
    let bb = ty.block_bytes();
    if !row.len().is_multiple_of(bb) || out.len() != row.len() / bb * BLOCK {
        return Err(format!("{ty:?}: {} bytes do not dequantize to {} values", row.len(), out.len()));
    }
    for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
        let d = read_f16(blk, 0);
        match ty {
            QuantType::Q8_0 => {
                for (o, &q) in o.iter_mut().zip(&blk[2..]) {
                    *o = d * (q as i8) as f32;
                }
            }
            QuantType::Q4_0 | QuantType::Q4_1 => {
                let (m, qs) = match ty {
                    QuantType::Q4_1 => (read_f16(blk, 2), &blk[4..]),
                    _ => (0.0, &blk[2..]),
                };
                for (i, &b) in qs.iter().enumerate() {
                    let (lo, hi) = ((b & 0x0f) as f32, (b >> 4) as f32);
                    if ty == QuantType::Q4_0 {
                        o[i] = d * (lo - 8.0);
                        o[i + 16] = d * (hi - 8.0);
                    } else {
                        o[i] = d * lo + m;
                        o[i + 16] = d * hi + m;
                    }
                }
            }
        }
    }
    Ok(())
}
