//! `Scheduler::validate`: checks every invariant the scheduler promises (see the
//! `scheduler` module doc) by walking all of its state. O(everything); for tests and fuzzing.

use crate::scheduler::{blocks_for, Scheduler, State, PLACEHOLDER};

impl Scheduler {
    /// Check every invariant in the module doc. O(everything); for tests.
    pub fn validate(&self) -> Result<(), String> {
        self.pool.validate()?;
        let bs = self.cfg.block_size;
        let mut refs = vec![0u32; self.pool.num_blocks()];
        let (mut n_wait, mut n_run) = (0, 0);
        for (slot, seq) in self.seqs.iter().enumerate() {
            match seq.state {
                State::Free => {
                    if !seq.blocks.is_empty() {
                        return Err(format!("released slot {slot} holds blocks"));
                    }
                    continue;
                }
                State::Waiting => {
                    n_wait += 1;
                    if !seq.blocks.is_empty() || seq.num_computed != 0 {
                        return Err(format!("waiting slot {slot} holds blocks or computed tokens"));
                    }
                    if !self.waiting.contains(&self.key(slot as u32)) {
                        return Err(format!("waiting slot {slot} is not queued"));
                    }
                }
                State::Running => {
                    n_run += 1;
                    if seq.blocks.len() != blocks_for(seq.num_computed, bs) {
                        return Err(format!(
                            "running slot {slot}: {} blocks for {} computed tokens",
                            seq.blocks.len(),
                            seq.num_computed
                        ));
                    }
                    if seq.num_computed > seq.tokens.len() || seq.num_hashed > seq.blocks.len() {
                        return Err(format!("running slot {slot}: counters out of range"));
                    }
                }
            }
            if seq.drafts > 0 {
                let row = self.inflight.iter().find_map(|p| {
                    p.rows.iter().find(|row| row.slot == slot as u32 && row.gen == seq.gen && row.drafts > 0)
                });
                if seq.state != State::Running
                    || row.is_none_or(|row| row.drafts as usize != seq.drafts)
                    || seq.tokens.len() <= seq.prompt_len + seq.drafts
                {
                    return Err(format!("slot {slot}: drafts without their awaiting rows"));
                }
            }
            if let Some(r) = seq.pending {
                let row = self.inflight.front().and_then(|p| p.rows.get(r as usize));
                if seq.state != State::Running
                    || seq.tokens.last() != Some(&PLACEHOLDER)
                    || row.is_none_or(|row| row.slot != slot as u32 || row.gen != seq.gen)
                {
                    return Err(format!("slot {slot}: a placeholder without its awaiting row"));
                }
            } else if seq.tokens.contains(&PLACEHOLDER) {
                return Err(format!("slot {slot}: a placeholder token that nothing replaces"));
            }
            let Some(req) = self.reqs[seq.req as usize].as_ref() else {
                return Err(format!("slot {slot} belongs to a dead request"));
            };
            if seq.awaits_pick
                && (!req.sampling.beam || (seq.state == State::Running && seq.num_computed != seq.tokens.len()))
            {
                return Err(format!("slot {slot} awaits a pick outside a beam search or with tokens to compute"));
            }
            if !req.seqs.contains(&(slot as u32)) {
                return Err(format!("slot {slot} missing from its request"));
            }
            for &b in &seq.blocks {
                if b == 0 || b as usize >= refs.len() {
                    return Err(format!("slot {slot} holds invalid block {b}"));
                }
                refs[b as usize] += 1;
            }
        }
        for c in &self.pending_copies {
            refs[c.src as usize] += 1;
        }
        for (b, &r) in refs.iter().enumerate().skip(1) {
            if self.pool.ref_count(b as u32) != r {
                return Err(format!("block {b}: ref count {} but {r} holders", self.pool.ref_count(b as u32)));
            }
        }
        if n_wait != self.waiting.len() || n_run != self.running.len() {
            return Err("queue lengths disagree with sequence states".into());
        }
        if self.inflight.len() > 2 {
            return Err(format!("{} plans await commit", self.inflight.len()));
        }
        if self.running.windows(2).any(|w| w[0] >= w[1]) {
            return Err("running list is not in policy order".into());
        }
        for (id, &rs) in &self.req_index {
            let req = self.reqs[rs as usize].as_ref().ok_or("index points at a dead request")?;
            if req.id != *id || (req.unfinished as usize) < req.seqs.len() || req.unfinished == 0 {
                return Err(format!("request {id}: bookkeeping is inconsistent"));
            }
        }
        Ok(())
    }
}
