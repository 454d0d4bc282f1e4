//! One prompt's beam search (vLLM's `use_beam_search`): which beams live, which have ended,
//! and how a step's rows continue them. The scheduler runs the live beams as sequences
//! (`Scheduler::advance_beams` forks and releases them); `Core` feeds each step's rows here
//! and, once no beam lives, replays the best finished ones through the response builder.
//!
//! Each step ranks, for every live beam, its `2 * width` likeliest next tokens by the
//! beam's cumulative logprob plus the token's. A token that ends a beam (eos, a stop token id)
//! sets the beam aside finished; of the others the best `width` continue, and one that reaches
//! the length limit is set aside too. The finished beams are ranked by their cumulative
//! logprob over their length (prompt included, the ending token not, as vLLM counts it) to
//! the power `length_penalty`.
//!
//! The search ends when no beam lives, or earlier when `width` finished beams already rank
//! above anything a live beam could still reach: its cumulative logprob can only fall, so its
//! score is at most that logprob over the most favourable length it may still end at. The
//! early end changes no result, only saves the steps.

use std::sync::Arc;

/// One token of a beam: its id, raw logprob and the alternatives the request shows.
#[derive(Clone, Debug, PartialEq)]
pub struct BeamToken {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// A beam's tokens as a chain from its last back to its first, shared by the beams that
/// forked from one another: a step adds one link per beam, never copies a path.
#[derive(Debug)]
struct Link {
    token: BeamToken,
    prev: Option<Arc<Link>>,
}

fn path(last: &Option<Arc<Link>>) -> Vec<BeamToken> {
    let mut out = Vec::new();
    let mut at = last.as_ref();
    while let Some(link) = at {
        out.push(link.token.clone());
        at = link.prev.as_ref();
    }
    out.reverse();
    out
}

#[derive(Debug)]
struct Live {
    /// The scheduler's index of the sequence that runs it.
    index: u32,
    last: Option<Arc<Link>>,
    cum: f64,
    /// Generated tokens.
    len: usize,
}

/// How a finished beam ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BeamEnd {
    /// By a token that ends it (its last).
    Token,
    Length,
}

/// A finished beam.
#[derive(Debug)]
pub struct Finished {
    pub tokens: Vec<BeamToken>,
    pub end: BeamEnd,
    /// Its cumulative logprob over its length to the power `length_penalty`.
    pub score: f64,
}

/// What ends a beam, and when it may.
pub struct Limits {
    pub max_tokens: usize,
    /// Prompt plus output may not pass this.
    pub max_model_len: usize,
    /// Ending tokens do not count (are never picked) before this many outputs.
    pub min_tokens: usize,
}

pub struct BeamSearch {
    width: usize,
    prompt_len: usize,
    length_penalty: f64,
    limits: Limits,
    live: Vec<Live>,
    /// The rows given so far for this step's live beams (sequence index, top tokens): a step
    /// is taken once every live beam has given its own.
    given: Vec<(u32, Vec<(u32, f32)>)>,
    done: Vec<Finished>,
}

impl BeamSearch {
    pub fn new(width: usize, prompt_len: usize, length_penalty: f64, limits: Limits) -> Self {
        let first = Live { index: 0, last: None, cum: 0.0, len: 0 };
        BeamSearch { width, prompt_len, length_penalty, limits, live: vec![first], given: Vec::new(), done: Vec::new() }
    }

    /// How many alternatives a beam's row must return: the candidates of a step.
    pub fn candidates(&self) -> usize {
        2 * self.width
    }

    fn score(&self, cum: f64, len: usize) -> f64 {
        cum / (len as f64).powf(self.length_penalty)
    }

    /// One step, once every live beam has given its row. `rows`: rows of live beams, their
    /// sequence index and likeliest next tokens (most likely first; the first `candidates()`
    /// are ranked) with their raw logprobs; they may come over several calls (the scheduler
    /// runs a beam whose blocks or place in a step are short later, and the others await
    /// it). `shown` of the tokens go with a picked one (the request's own `top_logprobs`);
    /// `ends(token)`: whether the token ends a beam. None while some live beam's row is
    /// missing; else the continuations, (parent index, token) each, for
    /// `Scheduler::advance_beams`, whose indices `renumber` then takes.
    pub fn step(
        &mut self,
        rows: &[(u32, Vec<(u32, f32)>)],
        shown: usize,
        ends: impl Fn(u32) -> bool,
    ) -> Option<Vec<(u32, u32)>> {
        for (index, top) in rows {
            if !self.live.iter().any(|l| l.index == *index) {
                continue;
            }
            match self.given.iter_mut().find(|g| g.0 == *index) {
                Some(g) => g.1.clone_from(top),
                None => self.given.push((*index, top.clone())),
            }
        }
        if self.given.len() < self.live.len() {
            return None;
        }
        let mut given = std::mem::take(&mut self.given);
        let mut candidates: Vec<(f64, usize, BeamToken)> = Vec::new();
        let live = std::mem::take(&mut self.live);
        for (b, beam) in live.iter().enumerate() {
            let at = given.iter().position(|g| g.0 == beam.index).expect("every live beam gave its row");
            let top = given.swap_remove(at).1;
            let shown_top: Vec<(u32, f32)> = top.iter().take(shown).copied().collect();
            for &(id, lp) in top.iter().take(self.candidates()) {
                if !lp.is_finite() {
                    continue;
                }
                let token = BeamToken { id, logprob: lp, top: shown_top.clone() };
                let cum = beam.cum + f64::from(lp);
                if ends(id) {
                    if beam.len + 1 >= self.limits.min_tokens {
                        let mut tokens = path(&beam.last);
                        tokens.push(token);
                        let score = self.score(cum, self.prompt_len + beam.len);
                        self.done.push(Finished { tokens, end: BeamEnd::Token, score });
                    }
                } else {
                    candidates.push((cum, b, token));
                }
            }
        }
        // best first; equal ones keep their order (beam, then the token's rank)
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
        candidates.truncate(self.width);
        let mut picks = Vec::with_capacity(candidates.len());
        for (cum, b, token) in candidates {
            let parent = &live[b];
            let len = parent.len + 1;
            let id = token.id;
            let last = Some(Arc::new(Link { token, prev: parent.last.clone() }));
            if len >= self.limits.max_tokens || self.prompt_len + len >= self.limits.max_model_len {
                let score = self.score(cum, self.prompt_len + len);
                self.done.push(Finished { tokens: path(&last), end: BeamEnd::Length, score });
            } else {
                picks.push((parent.index, id));
                self.live.push(Live { index: parent.index, last, cum, len });
            }
        }
        if self.settled() {
            self.live.clear();
            picks.clear();
        }
        Some(picks)
    }

    /// The scheduler's sequence index of each continuation `step` returned, in its order.
    pub fn renumber(&mut self, indices: &[u32]) {
        for (beam, &index) in self.live.iter_mut().zip(indices) {
            beam.index = index;
        }
    }

    /// Whether `width` finished beams rank at or above the best score any live beam can
    /// still reach.
    fn settled(&mut self) -> bool {
        if self.done.len() < self.width || self.live.is_empty() {
            return false;
        }
        self.done.sort_by(|a, b| b.score.total_cmp(&a.score));
        let bar = self.done[self.width - 1].score;
        let longest = (self.prompt_len + self.limits.max_tokens).min(self.limits.max_model_len);
        self.live.iter().all(|beam| {
            // (cum <= 0 only falls; cum / len^p is monotonic in len, so its best is at an end)
            let shortest = self.prompt_len + beam.len;
            let reach = self.score(beam.cum, shortest).max(self.score(beam.cum, longest));
            bar >= reach
        })
    }

    pub fn is_done(&self) -> bool {
        self.live.is_empty()
    }

    /// The best `width` finished beams, best first (ties keep the order they ended in).
    pub fn results(&mut self) -> Vec<Finished> {
        let mut done = std::mem::take(&mut self.done);
        done.sort_by(|a, b| b.score.total_cmp(&a.score));
        done.truncate(self.width);
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 0;

    fn limits(max_tokens: usize) -> Limits {
        Limits { max_tokens, max_model_len: 1000, min_tokens: 0 }
    }

    /// The tokens of each result.
    fn ids(results: &[Finished]) -> Vec<Vec<u32>> {
        results.iter().map(|f| f.tokens.iter().map(|t| t.id).collect()).collect()
    }

    /// A model: the next-token logprobs after a prefix, most likely first.
    type Model = fn(&[u32]) -> Vec<(u32, f32)>;

    /// Brute force over every continuation of up to `max_tokens` steps (ending earlier on
    /// EOS): all of them by score, best first.
    fn exhaustive(lp: Model, prompt_len: usize, max_tokens: usize, penalty: f64) -> Vec<(Vec<u32>, f64)> {
        let mut out = Vec::new();
        let mut stack = vec![(Vec::new(), 0.0f64)];
        while let Some((seq, cum)) = stack.pop() {
            for (t, l) in lp(&seq) {
                let mut next = seq.clone();
                next.push(t);
                let cum = cum + f64::from(l);
                if t == EOS {
                    out.push((next, cum / ((prompt_len + seq.len()) as f64).powf(penalty)));
                } else if next.len() == max_tokens {
                    out.push((next.clone(), cum / ((prompt_len + next.len()) as f64).powf(penalty)));
                } else {
                    stack.push((next, cum));
                }
            }
        }
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        out
    }

    /// A toy model over tokens 0..4 (0 is EOS) whose distribution depends on the prefix.
    fn toy(prefix: &[u32]) -> Vec<(u32, f32)> {
        let h = prefix.iter().fold(7u32, |h, &t| h.wrapping_mul(31).wrapping_add(t + 1));
        let raw: Vec<f32> = (0..4).map(|t| ((h.wrapping_mul(t + 3) % 17) as f32) / 4.0).collect();
        let z = raw.iter().map(|x| x.exp()).sum::<f32>().ln();
        let mut v: Vec<(u32, f32)> = raw.iter().enumerate().map(|(t, x)| (t as u32, x - z)).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    /// Runs a search on the toy model to its end, the caller acting as the scheduler (a
    /// parent's first pick keeps its index, the others get fresh ones, as `advance_beams`
    /// gives them). `early: false` hides the finished beams from each step, so the search
    /// never ends early. Returns its results and the steps it took.
    fn run(width: usize, max_tokens: usize, penalty: f64, early: bool) -> (Vec<Finished>, usize) {
        let mut search = BeamSearch::new(width, 5, penalty, limits(max_tokens));
        let mut seqs: Vec<(u32, Vec<u32>)> = vec![(0, Vec::new())];
        let mut next = 1;
        let mut steps = 0;
        while !search.is_done() {
            steps += 1;
            let rows: Vec<(u32, Vec<(u32, f32)>)> = seqs.iter().map(|(i, s)| (*i, toy(s))).collect();
            let hidden = if early { Vec::new() } else { std::mem::take(&mut search.done) };
            let picks = search.step(&rows, 2, |t| t == EOS).unwrap();
            search.done.splice(0..0, hidden);
            let mut taken = Vec::new();
            let mut indices = Vec::new();
            let mut new_seqs = Vec::new();
            for &(parent, token) in &picks {
                let mut s = seqs.iter().find(|(i, _)| *i == parent).unwrap().1.clone();
                s.push(token);
                let index = if taken.contains(&parent) {
                    next += 1;
                    next - 1
                } else {
                    taken.push(parent);
                    parent
                };
                indices.push(index);
                new_seqs.push((index, s));
            }
            search.renumber(&indices);
            seqs = new_seqs;
        }
        (search.results(), steps)
    }

    #[test]
    fn a_width_as_wide_as_every_path_finds_the_exact_best() {
        // 3 non-EOS tokens per step, 3 steps: at most 27 live paths, and width 27 keeps all
        let reference = exhaustive(toy, 5, 3, 1.0);
        let (results, _) = run(27, 3, 1.0, true);
        assert_eq!(results.len(), 27);
        for (got, (want, score)) in results.iter().zip(&reference) {
            assert!((got.score - score).abs() < 1e-9, "{got:?} vs {want:?}");
        }
        assert_eq!(ids(&results)[0], reference[0].0);
    }

    #[test]
    fn results_are_ranked_by_score_and_end_as_they_ended() {
        let (results, _) = run(3, 6, 1.0, true);
        assert_eq!(results.len(), 3);
        assert!(results.windows(2).all(|w| w[0].score >= w[1].score));
        for f in &results {
            let last = f.tokens.last().unwrap().id;
            match f.end {
                BeamEnd::Token => assert_eq!(last, EOS),
                BeamEnd::Length => assert_eq!(f.tokens.len(), 6),
            }
            // (length 1.0: the prompt's 5 tokens and the output's but an ending token)
            let cum: f64 = f.tokens.iter().map(|t| f64::from(t.logprob)).sum();
            let len = 5 + f.tokens.len() - usize::from(f.end == BeamEnd::Token);
            assert!((cum / len as f64 - f.score).abs() < 1e-9);
            assert!(f.tokens.iter().all(|t| t.top.len() == 2));
        }
    }

    #[test]
    fn the_early_end_changes_no_result() {
        let mut saved = 0;
        for penalty in [0.0, 0.5, 1.0, 2.0, -1.0] {
            for width in [1, 2, 3] {
                let (early, steps) = run(width, 12, penalty, true);
                let (late, late_steps) = run(width, 12, penalty, false);
                assert_eq!(ids(&early), ids(&late), "penalty {penalty}, width {width}");
                assert!(steps <= late_steps);
                saved += late_steps - steps;
            }
        }
        assert!(saved > 0, "some search ends early");
    }

    #[test]
    fn a_step_waits_for_every_live_beams_row() {
        let rows = |search: &mut BeamSearch| {
            let picks = search.step(&[(0, vec![(5, -1.0), (6, -1.5), (7, -3.0), (8, -4.0)])], 0, |t| t == EOS);
            search.renumber(&[0, 1]);
            picks
        };
        let (mut whole, mut parts) = (BeamSearch::new(2, 3, 1.0, limits(8)), BeamSearch::new(2, 3, 1.0, limits(8)));
        assert_eq!(rows(&mut whole), rows(&mut parts));
        let beam0 = (0, vec![(9, -2.0), (10, -2.5), (11, -3.0), (12, -5.0)]);
        let beam1 = (1, vec![(13, -0.1), (14, -0.2), (15, -2.5), (16, -5.0)]);
        let together = whole.step(&[beam0.clone(), beam1.clone()], 0, |t| t == EOS).unwrap();
        // beam 1's row first, alone; a row of no live beam is not taken
        assert_eq!(parts.step(&[beam1, (7, vec![(1, -0.01)])], 0, |t| t == EOS), None);
        assert_eq!(parts.step(&[beam0], 0, |t| t == EOS), Some(together.clone()));
        assert_eq!(together, vec![(1, 13), (1, 14)]);
    }

    #[test]
    fn ending_tokens_wait_for_min_tokens() {
        let mut search = BeamSearch::new(2, 3, 1.0, Limits { max_tokens: 10, max_model_len: 100, min_tokens: 2 });
        let rows = vec![(0, vec![(EOS, -0.1), (5, -1.0), (6, -2.0), (7, -3.0)])];
        let picks = search.step(&rows, 0, |t| t == EOS);
        assert_eq!(picks, Some(vec![(0, 5), (0, 6)]));
        assert!(search.done.is_empty(), "eos at the first output is not an end");
        search.renumber(&[0, 1]);
        let rows = vec![(0, vec![(EOS, -0.1), (5, -1.0)]), (1, vec![(EOS, -0.2), (8, -1.0)])];
        search.step(&rows, 0, |t| t == EOS);
        assert_eq!(search.done.len(), 2);
    }

    #[test]
    fn the_length_limit_ends_every_beam() {
        let mut search = BeamSearch::new(2, 3, 1.0, Limits { max_tokens: 1, max_model_len: 100, min_tokens: 0 });
        let picks = search.step(&[(0, vec![(5, -1.0), (6, -2.0), (7, -3.0)])], 0, |t| t == EOS).unwrap();
        assert!(picks.is_empty() && search.is_done());
        let results = search.results();
        assert_eq!(ids(&results), vec![vec![5], vec![6]]);
        assert!(results.iter().all(|f| f.end == BeamEnd::Length));
        assert!((results[0].score - (-1.0 / 4.0)).abs() < 1e-9, "prompt and output count in the length");
    }
}
