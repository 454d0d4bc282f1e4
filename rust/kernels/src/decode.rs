//! Paged-attention decode: one query token per sequence, keys and values read in place
//! through the block tables.
//!
//! Shapes (all row-major f32 / i32 slices):
//!   q, out        [num_seqs, num_heads, head_dim]
//!   k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]
//!   block_tables  [num_seqs, block_table_width]   (only the first ceil(seq_len / block_size)
//!                                                  entries of a row are read)
//!   seq_lens      [num_seqs]                      (tokens to attend over, >= 1)
//!
//! With a `window` (sliding-window attention), a sequence attends over its last `window` tokens
//! only: the blocks and rows before them are not read. With a `softcap` (Gemma 2's attention
//! logit soft-capping), each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
//!
//! Work item: one (sequence, kv head) with all `num_heads / num_kv_heads` query heads of its
//! group, so every K/V row is read from memory once per group. A block of keys is one softmax
//! tile: the scores of the tile are computed for every query head of the group, the running max
//! and sum are updated once per tile (online softmax, f32), and V rows are accumulated with the
//! tile's weights. Threads of the kernels' pool (`pool.rs`) take items a few at a time from a shared
//! queue; an item is always computed whole by one thread, so the result does not depend on the
//! thread count.
//!
//! How a score is summed depends on the instruction set, never on the batch or the threads: on
//! AVX2 in 8 lanes of partial sums, then a tree; on AVX-512 as two running sums, with the tile's
//! keys transposed into lanes (a key per lane), which needs no horizontal sums and lets every
//! query vector that reads the tile (all rows of a prompt's group) share one transposition.

use std::sync::Mutex;

use crate::kv_elem::KvElem;
use crate::simd;

mod avx2;
mod avx512;

/// How many blocks ahead of the one being computed to prefetch.
///
/// NOTE: measured at batch 64 x 257 cached tokens (SmolLM2's 9/3 heads, 2 threads), where the
/// kernel reads K/V from memory: 4 was ~1.3x faster than 2, and 8 no better than 4.
const AHEAD: usize = 4;

/// The sizes of one decode call (see the module doc for the layouts they describe).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeShape {
    pub num_seqs: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub block_table_width: usize,
    /// Multiplies q . k before the softmax (usually head_dim^-0.5).
    pub scale: f32,
    /// Attend over the last `window` tokens of each sequence only; 0: over all of them.
    pub window: usize,
    /// Soft-cap the scaled scores at +-`softcap` (tanh); 0: no cap.
    pub softcap: f32,
}

/// Which code the CPU runs: chosen once per call from `is_x86_feature_detected!`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Generic,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    /// AVX-512F (with AVX2, FMA and F16C): scores with a tile's keys in lanes, two running sums
    /// each in head-dim order (AVX2's are 8 lanes of sums, then a tree), and the softmax 16
    /// lanes at a time; the values' sums are AVX2's, bit for bit, more of them per instruction.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            if is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            return Isa::Avx2Fma;
        }
        Isa::Generic
    }

    /// This CPU's instruction sets, the detected one last (for tests that run every path).
    #[cfg(test)]
    pub(crate) fn supported() -> Vec<Isa> {
        let mut v = vec![Isa::Generic];
        #[cfg(target_arch = "x86_64")]
        if Isa::detect() != Isa::Generic {
            v.push(Isa::Avx2Fma);
            if Isa::detect() == Isa::Avx512 {
                v.push(Isa::Avx512);
            }
        }
        v
    }
}

/// out = softmax(scale * q k^T) v per (sequence, query head), over the sequence's first
/// `seq_lens[s]` cached tokens. The caches hold any [`KvElem`], widened exactly to f32 a block
/// at a time: the arithmetic is the f32 cache's. `num_threads` (>= 1; 0 counts as 1) threads
/// share the work; the result is the same for any thread count.
///
/// Errors (nothing is written): any slice whose length does not match `shape`, heads not a
/// multiple of kv heads, a zero size, a non-finite scale, a seq_len of 0 or beyond the block
/// table, a block id outside `0..num_blocks`.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention<E: KvElem>(
    out: &mut [f32],
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i32],
    seq_lens: &[i32],
    shape: DecodeShape,
    num_threads: usize,
) -> Result<(), String> {
    #[cfg(test)]
    let isa = FORCED_ISA.get().unwrap_or_else(Isa::detect);
    #[cfg(not(test))]
    let isa = Isa::detect();
    run(out, q, k_cache, v_cache, block_tables, seq_lens, shape, num_threads, isa)
}

#[cfg(test)]
thread_local! {
    /// Tests' choice of instruction set for [`paged_decode_attention`] called on this thread (as
    /// a whole decoder layer calls it); None: the detected one.
    pub(crate) static FORCED_ISA: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

/// The argument checks of [`paged_decode_attention`] alone (nothing is computed).
pub(crate) fn check<E: KvElem>(
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i32],
    seq_lens: &[i32],
    shape: DecodeShape,
) -> Result<(), String> {
    Ctx::validate(q, k_cache, v_cache, block_tables, seq_lens, shape).map(|_| ())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn run<E: KvElem>(
    out: &mut [f32],
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i32],
    seq_lens: &[i32],
    shape: DecodeShape,
    num_threads: usize,
    isa: Isa,
) -> Result<(), String> {
    let ctx = Ctx::validate(q, k_cache, v_cache, block_tables, seq_lens, shape)?;
    if out.len() != q.len() {
        return Err(format!("out has {} elements, q has {}", out.len(), q.len()));
    }
    let items = shape.num_seqs * shape.num_kv_heads;
    if items == 0 {
        return Ok(());
    }
    let item_len = ctx.group * shape.head_dim; // out elements of one work item
    let threads = num_threads.clamp(1, items);
    if threads == 1 {
        run_items(&ctx, 0, out, isa);
        return Ok(());
    }
    // NOTE: items are handed out a few at a time from a shared queue rather than split in
    // fixed ranges: on a shared machine one thread can be descheduled mid-call (or start
    // late), and a static split would make the whole call wait for it. Where rows begin with
    // the same block (a prompt's tokens, forks of one prompt), whole rows go out, at least two
    // at a time, so that `attend_rows` reads their shared blocks once.
    let w = shape.block_table_width;
    let shares = shape.window == 0 && (1..shape.num_seqs).any(|r| ctx.tables[r * w] == ctx.tables[(r - 1) * w]);
    let grain = if shares {
        (shape.num_seqs / (threads * 8)).max(2) * shape.num_kv_heads
    } else {
        (items / (threads * 8)).max(1)
    };
    let queue = Mutex::new(out.chunks_mut(grain * item_len).enumerate());
    let work = || loop {
        let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
        let Some((i, chunk)) = next else { break };
        run_items(&ctx, i * grain, chunk, isa);
    };
    crate::pool::parallel(threads, &|_| work()); // the calling thread works too
    Ok(())
}

/// Validated views of one call's arguments.
struct Ctx<'a, E> {
    q: &'a [f32],
    k: &'a [E],
    v: &'a [E],
    tables: &'a [i32],
    seq_lens: Vec<usize>,
    shape: DecodeShape,
    group: usize,
}

fn mul(a: usize, b: usize, what: &str) -> Result<usize, String> {
    a.checked_mul(b).ok_or_else(|| format!("{what} overflows"))
}

impl<'a, E: KvElem> Ctx<'a, E> {
    fn validate(
        q: &'a [f32],
        k: &'a [E],
        v: &'a [E],
        tables: &'a [i32],
        seq_lens: &[i32],
        s: DecodeShape,
    ) -> Result<Self, String> {
        if s.num_heads == 0 || s.num_kv_heads == 0 || s.head_dim == 0 || s.block_size == 0 {
            return Err(format!("num_heads, num_kv_heads, head_dim and block_size must be > 0: {s:?}"));
        }
        if !s.num_heads.is_multiple_of(s.num_kv_heads) {
            return Err(format!("num_heads ({}) must be a multiple of num_kv_heads ({})", s.num_heads, s.num_kv_heads));
        }
        if !s.scale.is_finite() {
            return Err(format!("scale must be finite, got {}", s.scale));
        }
        if !(s.softcap.is_finite() && s.softcap >= 0.0) {
            return Err(format!("softcap must be finite and >= 0, got {}", s.softcap));
        }
        let q_len = mul(mul(s.num_seqs, s.num_heads, "q size")?, s.head_dim, "q size")?;
        if q.len() != q_len {
            return Err(format!("q has {} elements, expected num_seqs x num_heads x head_dim = {q_len}", q.len()));
        }
        let block_len = mul(mul(s.block_size, s.num_kv_heads, "block size")?, s.head_dim, "block size")?;
        if !k.len().is_multiple_of(block_len) || k.len() != v.len() {
            return Err(format!(
                "k_cache ({}) and v_cache ({}) must hold the same whole number of blocks of \
                 block_size x num_kv_heads x head_dim = {block_len} elements",
                k.len(),
                v.len()
            ));
        }
        let num_blocks = k.len() / block_len;
        if tables.len() != mul(s.num_seqs, s.block_table_width, "block_tables size")? {
            return Err(format!(
                "block_tables has {} entries, expected num_seqs x block_table_width = {} x {}",
                tables.len(),
                s.num_seqs,
                s.block_table_width
            ));
        }
        if seq_lens.len() != s.num_seqs {
            return Err(format!("seq_lens has {} entries, expected num_seqs = {}", seq_lens.len(), s.num_seqs));
        }
        let max_len = mul(s.block_table_width, s.block_size, "block table capacity")?;
        let mut lens = Vec::with_capacity(s.num_seqs);
        for (i, &len) in seq_lens.iter().enumerate() {
            if len < 1 || len as usize > max_len {
                return Err(format!("seq_lens[{i}] = {len} is outside 1..={max_len} (block_table_width x block_size)"));
            }
            let len = len as usize;
            let row = &tables[i * s.block_table_width..][..len.div_ceil(s.block_size)];
            if let Some(&b) = row.iter().find(|&&b| b < 0 || b as usize >= num_blocks) {
                return Err(format!("block_tables[{i}] holds block id {b}, outside 0..{num_blocks}"));
            }
            lens.push(len);
        }
        Ok(Ctx { q, k, v, tables, seq_lens: lens, shape: s, group: s.num_heads / s.num_kv_heads })
    }
}

fn run_items<E: KvElem>(ctx: &Ctx<'_, E>, first: usize, out: &mut [f32], isa: Isa) {
    match isa {
        Isa::Generic => items_impl::<E, false, false>(ctx, first, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx2Fma is only constructed after is_x86_feature_detected! found all three.
        Isa::Avx2Fma => unsafe { items_avx2(ctx, first, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx512 is only constructed after is_x86_feature_detected! found all four.
        Isa::Avx512 => unsafe { items_avx512(ctx, first, out) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn items_avx2<E: KvElem>(ctx: &Ctx<'_, E>, first: usize, out: &mut [f32]) {
    items_impl::<E, true, false>(ctx, first, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn items_avx512<E: KvElem>(ctx: &Ctx<'_, E>, first: usize, out: &mut [f32]) {
    items_impl::<E, true, true>(ctx, first, out)
}

/// Work items first.. (as many as `out` holds), out = their [group, head_dim] outputs.
///
/// Consecutive items of one sequence (its kv heads h0..h1) are computed together, block by
/// block: a token's K (and V) rows of those heads are adjacent in the cache, so each block is
/// read as one contiguous stretch the hardware prefetchers follow, instead of 256-byte pieces
/// at a 768-byte stride once per kv head. Consecutive whole rows that begin with the same block
/// (a prompt's tokens, each a row of its own, or forks of one prompt: [`shared_rows`]) are
/// computed together too, each block they share once for all of them ([`attend_rows`]). Each item's arithmetic, in token order, is the
/// same whichever items share its run, so the result still does not depend on the threads.
#[inline(always)]
fn items_impl<E: KvElem, const FMA: bool, const WIDE: bool>(ctx: &Ctx<'_, E>, first: usize, out: &mut [f32]) {
    let s = &ctx.shape;
    let item_len = ctx.group * s.head_dim;
    let row_len = s.num_heads * s.head_dim;
    // per-thread scratch, sized for all heads of a sequence and reused across runs
    let mut scratch = Scratch {
        qs: vec![0f32; s.num_heads * s.head_dim],
        acc: vec![0f32; s.num_heads * s.head_dim],
        scores: vec![0f32; s.num_heads * s.block_size],
        m: vec![0f32; s.num_heads],
        l: vec![0f32; s.num_heads],
        // (a block's rows widened to f32, where the cache holds another type)
        keys: Vec::new(),
        vals: Vec::new(),
        kt: Vec::new(),
        jobs: Vec::new(),
    };
    let items = out.len() / item_len;
    let mut i = 0;
    while i < items {
        let (seq, h0) = ((first + i) / s.num_kv_heads, (first + i) % s.num_kv_heads);
        if h0 == 0 && s.window == 0 {
            let rows = shared_rows(ctx, seq, (items - i) / s.num_kv_heads);
            if rows > 1 {
                let o = &mut out[i * item_len..][..rows * row_len];
                attend_rows::<E, FMA, WIDE>(ctx, seq, rows, o, &mut scratch);
                i += rows * s.num_kv_heads;
                continue;
            }
        }
        let h1 = s.num_kv_heads.min(h0 + items - i);
        let o = &mut out[i * item_len..(i + h1 - h0) * item_len];
        attend_run::<E, FMA, WIDE>(ctx, seq, h0, h1, o, &mut scratch);
        i += h1 - h0;
    }
}

/// The most rows grouped by [`attend_rows`]: one block of a prompt's tokens (and at most
/// the bits of a `u16`).
const ROWS: usize = 16;

/// How many rows from `seq` on (at most `avail`, and [`ROWS`]) begin with the same block: a
/// prompt's consecutive tokens (each row's blocks the first of the next one's), or sequences
/// forked from one prompt (`n` > 1) or sharing a cached prefix, whose blocks part after it.
fn shared_rows<E>(ctx: &Ctx<'_, E>, seq: usize, avail: usize) -> usize {
    let w = ctx.shape.block_table_width;
    let first = ctx.tables[seq * w];
    1 + (seq + 1..seq + avail.min(ROWS)).take_while(|&r| ctx.tables[r * w] == first).count()
}

/// Rows seq..seq + rows (all their kv heads), which [`shared_rows`] found beginning with the
/// same block: block by block, each distinct block the rows hold there is read (and widened)
/// once for all the rows that hold it, and each row computes it exactly as [`attend_run`]
/// alone would (the same tiles, in the same order), so its result is the same bits.
/// out = [rows, num_heads, d].
#[inline(always)]
fn attend_rows<E: KvElem, const FMA: bool, const WIDE: bool>(
    ctx: &Ctx<'_, E>,
    seq: usize,
    rows: usize,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    let s = &ctx.shape;
    let (d, g, bs, nh) = (s.head_dim, ctx.group, s.block_size, s.num_heads);
    let row_stride = s.num_kv_heads * d;
    let block_stride = bs * row_stride;
    let lens = &ctx.seq_lens[seq..seq + rows];
    let tables: Vec<&[i32]> =
        (0..rows).map(|r| &ctx.tables[(seq + r) * s.block_table_width..][..lens[r].div_ceil(bs)]).collect();
    let blocks = tables.iter().map(|t| t.len()).max().unwrap_or(0);
    let row_len = nh * d;
    sc.qs.resize(rows * row_len, 0.0);
    sc.acc.resize(rows * row_len, 0.0);
    sc.m.resize(rows * nh, 0.0);
    sc.l.resize(rows * nh, 0.0);
    let (qs, acc) = (&mut sc.qs[..rows * row_len], &mut sc.acc[..rows * row_len]);
    let lanes = keys_in_lanes::<WIDE>(s);
    // (with keys in lanes, every row's scores of a tile are computed at once, then used row by row)
    sc.scores.resize(if lanes { rows } else { 1 } * nh * bs, 0.0);
    let (m, l, scores) = (&mut sc.m[..rows * nh], &mut sc.l[..rows * nh], &mut sc.scores[..]);
    for (dst, src) in qs.iter_mut().zip(&ctx.q[seq * row_len..][..rows * row_len]) {
        *dst = src * s.scale;
    }
    acc.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let span = |id: i32, n: usize| {
        let base = id as usize * block_stride;
        base..base + n * row_stride
    };
    // (the rows that hold block b and the first of them to hold each one: its readers)
    let holds = |r: usize, b: usize| tables[r].get(b).copied();
    let first_reader = |r: usize, b: usize| holds(r, b).is_some() && (0..r).all(|o| holds(o, b) != holds(r, b));
    let used = |r: usize, b: usize| bs.min(lens[r] - b * bs);
    let widest = |r: usize, b: usize| (r..rows).filter(|&o| holds(o, b) == holds(r, b)).map(|o| used(o, b)).max();
    let prefetch = |b: usize| {
        for r in (0..rows).filter(|&r| first_reader(r, b)) {
            for x in span(tables[r][b], widest(r, b).unwrap_or(0)).step_by(row_stride) {
                simd::prefetch(&ctx.k[x..x + row_stride]);
                simd::prefetch(&ctx.v[x..x + row_stride]);
            }
        }
    };
    (0..AHEAD).for_each(prefetch);
    for b in 0..blocks {
        prefetch(b + AHEAD);
        for first in (0..rows).filter(|&r| first_reader(r, b)) {
            let Some(id) = holds(first, b) else { continue };
            let whole = span(id, widest(first, b).unwrap_or(0));
            let (keys, vals) = as_f32::<E, FMA>(&ctx.k[whole.clone()], &ctx.v[whole], &mut sc.keys, &mut sc.vals);
            let readers = || (first..rows).filter(move |&r| holds(r, b) == Some(id));
            if lanes {
                let tile = avx2::Tile { n: widest(first, b).unwrap_or(0), row_stride, d, kvs: s.num_kv_heads, g, bs };
                let rows_of = readers().map(|r| (r, used(r, b)));
                lanes_scores(qs, row_len, rows_of, keys, tile, scores, &mut sc.kt, &mut sc.jobs);
            }
            for r in readers() {
                let n = used(r, b);
                let tile = avx2::Tile { n, row_stride, d, kvs: s.num_kv_heads, g, bs };
                let used = n * row_stride;
                let (qs, acc) = (&qs[r * row_len..][..row_len], &mut acc[r * row_len..][..row_len]);
                let (m, l) = (&mut m[r * nh..][..nh], &mut l[r * nh..][..nh]);
                let scores = match lanes {
                    true => &mut scores[r * nh * bs..][..nh * bs],
                    false => {
                        tile_scores::<FMA>(qs, &keys[..used], tile, scores);
                        &mut scores[..nh * bs]
                    }
                };
                softmax(lanes, scores, tile, s.softcap, m, l, acc);
                tile_accumulate::<FMA, WIDE>(scores, &vals[..used], tile, acc);
            }
        }
    }
    normalize(out, acc, l, d);
}

/// out[j] = acc[j] / l[j] for each query head j (rows of `d`): the softmax's division, once.
#[inline(always)]
fn normalize(out: &mut [f32], acc: &[f32], l: &[f32], d: usize) {
    for ((o, a), &l) in out.chunks_exact_mut(d).zip(acc.chunks_exact(d)).zip(l) {
        let inv = 1.0 / l;
        for (dst, a) in o.iter_mut().zip(a) {
            *dst = a * inv;
        }
    }
}

/// A block's key and value rows as f32: themselves for an f32 cache, else widened into
/// `kbuf` and `vbuf`.
///
/// NOTE: widened into buffers that stay in L1 (one block of the run's heads), then the f32
/// loops: the cache traffic, the bound of this kernel, is what a narrow type shrinks.
#[inline(always)]
fn as_f32<'s, E: KvElem, const FMA: bool>(
    keys: &'s [E],
    vals: &'s [E],
    kbuf: &'s mut Vec<f32>,
    vbuf: &'s mut Vec<f32>,
) -> (&'s [f32], &'s [f32]) {
    if let (Some(k), Some(v)) = (E::as_f32(keys), E::as_f32(vals)) {
        return (k, v);
    }
    kbuf.resize(keys.len(), 0.0);
    vbuf.resize(vals.len(), 0.0);
    E::widen(keys, kbuf, FMA);
    E::widen(vals, vbuf, FMA);
    (&kbuf[..keys.len()], &vbuf[..vals.len()])
}

/// [`online_softmax`], or its AVX-512 form where scores are computed with keys in lanes
/// (`lanes`: [`keys_in_lanes`]) and not soft-capped (every tile of a call takes the same one).
#[inline(always)]
fn softmax(
    lanes: bool,
    scores: &mut [f32],
    tile: avx2::Tile,
    softcap: f32,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if lanes && softcap == 0.0 {
        // SAFETY: `lanes` holds only inside `items_avx512`, after AVX-512F was detected; the
        // sizes are the tile's (checked by the callee).
        unsafe { avx512::online_softmax(scores, tile.n, tile.bs, m, l, acc) };
        return;
    }
    online_softmax(scores, tile, softcap, m, l, acc);
}

/// One tile's scores of every query head (soft-capped with a cap) into weights, with each
/// head's running max `m` and sum `l` updated and its accumulator rescaled to a new max.
#[inline(always)]
fn online_softmax(scores: &mut [f32], tile: avx2::Tile, softcap: f32, m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
    let avx2::Tile { n, d, kvs, g, bs, .. } = tile;
    let nh = kvs * g;
    if softcap > 0.0 {
        for j in 0..nh {
            for x in &mut scores[j * bs..j * bs + n] {
                *x = softcap * (*x / softcap).tanh();
            }
        }
    }
    for j in 0..nh {
        let tile = &mut scores[j * bs..j * bs + n];
        let new_m = m[j].max(simd::max(tile));
        if new_m > m[j] {
            // rescale what was accumulated under the old max (0 on the first tile)
            let c = simd::exp_neg(m[j] - new_m);
            l[j] *= c;
            simd::scale(&mut acc[j * d..(j + 1) * d], c);
            m[j] = new_m;
        }
        l[j] += simd::exp_sub_sum(tile, new_m);
    }
}

struct Scratch {
    qs: Vec<f32>,           // [heads, d] the run's queries, pre-scaled (rows x that, grouped rows)
    acc: Vec<f32>,          // [heads, d] unnormalized outputs (likewise)
    scores: Vec<f32>,       // [heads, block_size] one tile's scores, then weights (rows x that with keys in lanes)
    m: Vec<f32>,            // [heads] running max (likewise)
    l: Vec<f32>,            // [heads] running sum of weights (likewise)
    keys: Vec<f32>,         // one tile's key rows as f32 (a cache of another type only)
    vals: Vec<f32>,         // its value rows
    kt: Vec<f32>,           // [head_dim, 16] a kv head's keys of the tile, in lanes (AVX-512)
    jobs: Vec<avx512::Job>, // the query vectors scored against one kv head's `kt`
}

/// Sequence `seq`, kv heads h0..h1 with their query heads; out = [(h1 - h0) * group, d].
#[inline(always)]
fn attend_run<E: KvElem, const FMA: bool, const WIDE: bool>(
    ctx: &Ctx<'_, E>,
    seq: usize,
    h0: usize,
    h1: usize,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    let s = &ctx.shape;
    let (d, g, bs) = (s.head_dim, ctx.group, s.block_size);
    let nh = (h1 - h0) * g; // query heads in the run
    let row_stride = s.num_kv_heads * d; // between tokens of a block
    let block_stride = bs * row_stride;
    let len = ctx.seq_lens[seq];
    let lanes = keys_in_lanes::<WIDE>(s);
    let (qs, acc, scores) = (&mut sc.qs[..nh * d], &mut sc.acc[..nh * d], &mut sc.scores[..nh * bs]);
    let (m, l) = (&mut sc.m[..nh], &mut sc.l[..nh]);
    let q0 = (seq * s.num_heads + h0 * g) * d; // the run's query heads are contiguous
    for (dst, src) in qs.iter_mut().zip(&ctx.q[q0..q0 + nh * d]) {
        *dst = src * s.scale;
    }
    acc.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let table = &ctx.tables[seq * s.block_table_width..][..len.div_ceil(bs)];
    let start = if s.window > 0 { len.saturating_sub(s.window) } else { 0 }; // first key attended
    let first = start / bs;
    // block b: its valid rows and the span of the cache they cover (heads h0..h1)
    let rows = |b: usize| {
        let n = bs.min(len - b * bs);
        let base = table[b] as usize * block_stride + h0 * d;
        (n, base..base + (n - 1) * row_stride + (h1 - h0) * d)
    };
    let prefetch = |b: usize| {
        if b < table.len() {
            for r in rows(b).1.step_by(row_stride) {
                simd::prefetch(&ctx.k[r..r + (h1 - h0) * d]);
                simd::prefetch(&ctx.v[r..r + (h1 - h0) * d]);
            }
        }
    };
    (first..first + AHEAD).for_each(prefetch);
    for b in first..table.len() {
        prefetch(b + AHEAD);
        let (mut n, mut span) = rows(b);
        if b == first {
            // the window's first block: its rows from the window's start (at least one: start < len)
            let skip = start - b * bs;
            n -= skip;
            span.start += skip * row_stride;
        }
        let (keys, vals) = as_f32::<E, FMA>(&ctx.k[span.clone()], &ctx.v[span], &mut sc.keys, &mut sc.vals);
        let tile = avx2::Tile { n, row_stride, d, kvs: h1 - h0, g, bs };
        if lanes {
            lanes_scores(qs, 0, [(0, n)].into_iter(), keys, tile, scores, &mut sc.kt, &mut sc.jobs);
        } else {
            tile_scores::<FMA>(qs, keys, tile, scores);
        }
        softmax(lanes, scores, tile, s.softcap, m, l, acc);
        tile_accumulate::<FMA, WIDE>(scores, vals, tile, acc);
    }
    normalize(out, acc, l, d);
}

/// Whether scores are computed with the tile's keys in lanes ([`lanes_scores`]): AVX-512 (WIDE,
/// only inside `items_avx512`), head dims a multiple of 16 and blocks of at most 16 tokens.
#[inline(always)]
fn keys_in_lanes<const WIDE: bool>(s: &DecodeShape) -> bool {
    cfg!(target_arch = "x86_64") && WIDE && s.head_dim.is_multiple_of(16) && s.block_size <= 16
}

/// The scores of a tile for several rows at once: `scores[(r * heads + j) * bs + t] = q_rj . k_t`
/// for each (row r, its key count n) of `rows`, the query heads j of the tile's kv heads, and
/// t < n; `qs` holds row r's queries from `r * row_len`, `keys` the tile's widest rows. The keys
/// are laid out in lanes once ([`avx512::transpose_keys`]), then every query vector of a kv
/// head is scored against them ([`avx512::score_jobs`]): each score's sum is the same whichever
/// rows share the tile.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn lanes_scores(
    qs: &[f32],
    row_len: usize,
    rows: impl Iterator<Item = (usize, usize)> + Clone,
    keys: &[f32],
    tile: avx2::Tile,
    scores: &mut [f32],
    kt: &mut Vec<f32>,
    jobs: &mut Vec<avx512::Job>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2::Tile { n, row_stride, d, kvs, g, bs } = tile;
        let nh = kvs * g;
        assert!(keys.len() >= (n - 1) * row_stride + kvs * d && kvs * d <= row_stride);
        kt.resize(d * 16, 0.0); // (one kv head's at a time: it is scored before the next one)
        for kv in 0..kvs {
            // SAFETY: WIDE (keys_in_lanes) is true only inside `items_avx512`, after AVX-512F was
            // detected; `keys` holds n rows of kvs heads from kv * d (asserted above).
            unsafe { avx512::transpose_keys(keys.as_ptr().add(kv * d), n, row_stride, d, kt.as_mut_ptr()) };
            jobs.clear();
            let out = scores.as_mut_ptr();
            for (r, n) in rows.clone() {
                for j in kv * g..(kv + 1) * g {
                    let (q, at) = (&qs[r * row_len + j * d..][..d], (r * nh + j) * bs);
                    assert!(n <= bs && at + n <= scores.len());
                    // SAFETY: in bounds (asserted)
                    jobs.push(avx512::Job { q: q.as_ptr(), out: unsafe { out.add(at) }, n });
                }
            }
            // SAFETY: as above; each job's q holds d elements and out n <= bs <= 16.
            unsafe { avx512::score_jobs(kt.as_ptr(), jobs, d) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (qs, row_len, rows, keys, tile, scores, kt, jobs);
}

/// `scores[j * bs + t] = qs[j] . k_t` for the tile's keys and every query head of its kv
/// heads: the AVX2 loops where they apply (FMA is true only inside `items_avx2`, run after
/// AVX2 and FMA were detected), else one dot product per (key, query head).
#[inline(always)]
fn tile_scores<const FMA: bool>(qs: &[f32], keys: &[f32], tile: avx2::Tile, scores: &mut [f32]) {
    let avx2::Tile { n, row_stride, d, kvs, g, bs } = tile;
    #[cfg(target_arch = "x86_64")]
    if FMA && d % 64 == 0 {
        // SAFETY: see above; `keys` spans the tile's n rows of these kv heads.
        unsafe { avx2::scores(qs, keys, tile, scores) };
        return;
    }
    for t in 0..n {
        for kv in 0..kvs {
            let k_row = &keys[t * row_stride + kv * d..][..d];
            for j in kv * g..(kv + 1) * g {
                scores[j * bs + t] = simd::dot::<FMA>(&qs[j * d..(j + 1) * d], k_row);
            }
        }
    }
}

/// `acc[j] += sum_t weights[j * bs + t] * v_t`, in key order: the AVX-512 or AVX2 loops where
/// they apply (as for `tile_scores`; WIDE is true only inside `items_avx512`, the same bits),
/// else one axpy per (key, query head).
#[inline(always)]
fn tile_accumulate<const FMA: bool, const WIDE: bool>(
    weights: &[f32],
    vals: &[f32],
    tile: avx2::Tile,
    acc: &mut [f32],
) {
    let avx2::Tile { n, row_stride, d, kvs, g, bs } = tile;
    #[cfg(target_arch = "x86_64")]
    if WIDE && d % 64 == 0 {
        // SAFETY: as for the AVX2 loops, after AVX-512F was detected.
        unsafe { avx512::accumulate(weights, vals, tile, acc) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if FMA && d % 64 == 0 {
        // SAFETY: as for the scores, with `vals` spanning the tile's rows.
        unsafe { avx2::accumulate(weights, vals, tile, acc) };
        return;
    }
    for t in 0..n {
        for kv in 0..kvs {
            let v_row = &vals[t * row_stride + kv * d..][..d];
            for j in kv * g..(kv + 1) * g {
                simd::axpy::<FMA>(&mut acc[j * d..(j + 1) * d], weights[j * bs + t], v_row);
            }
        }
    }
}
