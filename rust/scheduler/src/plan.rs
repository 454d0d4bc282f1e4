//! Plan: one step's batch as flat columns, ready to cross into Python as arrays once.
//!
//! Shapes: `T` tokens, `S` scheduled sequences, `R` rows that sample, `W` block table
//! width, `C` block copies. See ARCHITECTURE.md ("Seam 2") for the column table.

/// One step's work. Columns are filled by the scheduler; the runner reads them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// T
    pub num_tokens: usize,
    /// S
    pub num_seqs: usize,
    /// R
    pub num_rows: usize,
    /// W: the most blocks any scheduled sequence holds; shorter tables are padded with the
    /// null block 0.
    pub block_table_width: usize,

    /// `[T]` token ids to run.
    pub input_ids: Vec<i64>,
    /// `[T]` absolute positions.
    pub positions: Vec<i64>,
    /// `[S+1]` prefix sums of tokens per sequence.
    pub query_start_loc: Vec<i32>,
    /// `[S]` context length after this step (cached + new).
    pub seq_lens: Vec<i32>,
    /// `[S*W]` row-major block ids, padded with 0.
    pub block_tables: Vec<i32>,
    /// `[T]` block * block_size + offset where each token's K/V is written.
    pub slot_mapping: Vec<i64>,
    /// `[C]` copy block src -> dst before the forward (the partial last block of a fork).
    pub copy_src: Vec<i64>,
    pub copy_dst: Vec<i64>,

    /// `[R]` index into the T tokens whose logits each row samples (forks repeat one).
    pub logits_indices: Vec<i64>,
    pub temperature: Vec<f32>,
    pub top_p: Vec<f32>,
    pub min_p: Vec<f32>,
    pub presence_penalty: Vec<f32>,
    pub frequency_penalty: Vec<f32>,
    pub repetition_penalty: Vec<f32>,
    /// `[R]` 0 = off.
    pub top_k: Vec<i32>,
    /// `[R]` -1 unseeded; else the request seed mixed with the sequence index.
    pub seeds: Vec<i64>,
    /// `[R]` output tokens the sequence had before this step.
    pub gen_index: Vec<i64>,
    /// `[R]` -1 none.
    pub num_logprobs: Vec<i32>,
    /// `[R+1]` CSR offsets into bias_token_ids / bias_values.
    pub bias_offsets: Vec<i32>,
    pub bias_token_ids: Vec<i64>,
    /// -inf for tokens banned until min_tokens.
    pub bias_values: Vec<f32>,
    /// `[R+1]` CSR offsets into hist_tokens; a row without penalties has an empty range.
    pub hist_offsets: Vec<i32>,
    /// prompt + output tokens of penalized rows.
    pub hist_tokens: Vec<i64>,
    /// `[R]` how many of a row's hist_tokens are prompt (0 for rows without penalties).
    pub hist_prompt_lens: Vec<i32>,
    /// `[R]` the sequence each row belongs to.
    pub row_req_ids: Vec<u64>,
    pub row_seq_index: Vec<u32>,

    /// `[P]` prompt-logprob entries (requests with `prompt_logprobs`): the row of the flat T
    /// tokens whose logits predict the next prompt token, that token, the request, and how
    /// many alternatives it wants. Each prompt position is listed once over the request's
    /// life, in position order (not again after preemption or a fork's recompute).
    pub prompt_lp_indices: Vec<i64>,
    pub prompt_lp_targets: Vec<i64>,
    pub prompt_lp_req_ids: Vec<u64>,
    pub prompt_lp_num: Vec<i32>,

    /// `[Q]` pooling entries (requests with `pooling`): the row of the flat T tokens whose
    /// final hidden state goes into the request's embedding, and the request. Each prompt
    /// position is listed once over the request's life, in position order.
    pub pool_indices: Vec<i64>,
    pub pool_req_ids: Vec<u64>,

    /// `[S]` the sequence each scheduled slot belongs to (not in ARCHITECTURE's table; for
    /// metrics, debugging and tests).
    pub seq_req_ids: Vec<u64>,
    pub seq_indices: Vec<u32>,
    /// `[S]` the LoRA adapter each scheduled sequence's tokens run through (0: none).
    pub lora_ids: Vec<u32>,
    /// `[S]` how many of each scheduled sequence's tokens are its prompt's: a sequence that
    /// recomputes its tokens (preempted, a beam that gave up its blocks) computes those past it
    /// as generated tokens (the runner: ModelRunner._parts).
    pub prompt_lens: Vec<i32>,
}

impl Plan {
    /// Nothing to run: no tokens and no block copies. An empty plan needs no commit.
    pub fn is_empty(&self) -> bool {
        self.num_tokens == 0 && self.copy_src.is_empty()
    }

    /// Columns with room for about `tokens` tokens, `seqs` sequences and `rows` rows, so a
    /// step fills them without reallocating.
    pub(crate) fn with_capacity(tokens: usize, seqs: usize, rows: usize) -> Self {
        Plan {
            input_ids: Vec::with_capacity(tokens),
            positions: Vec::with_capacity(tokens),
            slot_mapping: Vec::with_capacity(tokens),
            query_start_loc: Vec::with_capacity(seqs + 1),
            seq_lens: Vec::with_capacity(seqs),
            seq_req_ids: Vec::with_capacity(seqs),
            seq_indices: Vec::with_capacity(seqs),
            lora_ids: Vec::with_capacity(seqs),
            prompt_lens: Vec::with_capacity(seqs),
            logits_indices: Vec::with_capacity(rows),
            temperature: Vec::with_capacity(rows),
            top_p: Vec::with_capacity(rows),
            min_p: Vec::with_capacity(rows),
            presence_penalty: Vec::with_capacity(rows),
            frequency_penalty: Vec::with_capacity(rows),
            repetition_penalty: Vec::with_capacity(rows),
            top_k: Vec::with_capacity(rows),
            seeds: Vec::with_capacity(rows),
            gen_index: Vec::with_capacity(rows),
            num_logprobs: Vec::with_capacity(rows),
            bias_offsets: Vec::with_capacity(rows + 1),
            hist_offsets: Vec::with_capacity(rows + 1),
            hist_prompt_lens: Vec::with_capacity(rows),
            row_req_ids: Vec::with_capacity(rows),
            row_seq_index: Vec::with_capacity(rows),
            ..Plan::default()
        }
    }

    /// The block table row of scheduled sequence `s` (length W).
    pub fn block_table(&self, s: usize) -> &[i32] {
        let w = self.block_table_width;
        &self.block_tables[s * w..(s + 1) * w]
    }

    /// The token range of scheduled sequence `s` in the flat T columns.
    pub fn token_range(&self, s: usize) -> std::ops::Range<usize> {
        self.query_start_loc[s] as usize..self.query_start_loc[s + 1] as usize
    }
}

/// Mix a request seed with a sequence index so the n forks of one seeded request draw
/// different but reproducible streams. Index 0 keeps a seed below 2^63 as given. The result
/// is non-negative because -1 means "unseeded": a value with the top bit set is scrambled
/// into 63 bits rather than cut, so seeds that differ only in that bit (0 and 2^63, 2^63 - 1
/// and 2^64 - 1) still draw different streams.
pub fn mix_seed(seed: Option<u64>, seq_index: u32) -> i64 {
    let Some(seed) = seed else { return -1 };
    let mixed = if seq_index == 0 { seed } else { seed ^ splitmix64(u64::from(seq_index)) };
    let folded = if mixed >> 63 == 0 { mixed } else { splitmix64(mixed) >> 1 };
    folded as i64
}

/// splitmix64's finalizer: nearby inputs give unrelated outputs (a bijection of u64).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_mix_with_the_fork_index() {
        assert_eq!(mix_seed(None, 3), -1);
        assert_eq!(mix_seed(Some(42), 0), 42);
        assert_ne!(mix_seed(Some(42), 1), 42);
        assert_ne!(mix_seed(Some(42), 1), mix_seed(Some(42), 2));
        assert!(mix_seed(Some(u64::MAX), 0) >= 0);
        assert!(mix_seed(Some(u64::MAX), 5) >= 0);
        // the top bit counts (audit 12: 0 = 2^63 and 2^63 - 1 = 2^64 - 1 drew one stream)
        assert_ne!(mix_seed(Some(0), 0), mix_seed(Some(1 << 63), 0));
        assert_ne!(mix_seed(Some(i64::MAX as u64), 0), mix_seed(Some(u64::MAX), 0));
        assert_ne!(mix_seed(Some(0), 3), mix_seed(Some(1 << 63), 3));
    }
}
