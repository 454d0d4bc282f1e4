//! vLLM's `repetition_detection`: a choice ends once its output ends in `min_count` copies
//! of one pattern, back to back, for some pattern length in `min_pattern_size ..=
//! max_pattern_size` tokens (the loop a small model falls into, cut without waiting for
//! `max_tokens`).
//!
//! As vLLM checks it: over the sampled token ids (not the text, not the prompt; thinking
//! included), after every token once `min_tokens` have come, the shortest lengths first. The
//! token that completes the repetition is kept, and the choice ends with `finish_reason:
//! "repetition"` and `stop_reason: "repetition_detected"`. An end by eos, a stop token, a stop
//! string, a complete grammar or `max_tokens` on the same token wins.

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::protocol::chat::unknown_keys_in;
use crate::protocol::common::{invalid_type, kind_of};

/// The `stop_reason` of a choice that repetition ended.
pub const STOP_REASON: &str = "repetition_detected";

/// A request's `repetition_detection`, on (`max_pattern_size > 0`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RepetitionDetection {
    /// Shortest pattern, in tokens (at least 1).
    pub min_size: u32,
    /// Longest pattern, in tokens.
    pub max_size: u32,
    /// Copies in a row that end the choice (at least 2).
    pub min_count: u32,
}

impl RepetitionDetection {
    /// The request's `repetition_detection` object (`max_pattern_size`, `min_pattern_size`,
    /// `min_count`, each a non-negative integer, 0 when left out), or None when it is off
    /// (absent, null, or `max_pattern_size` 0). Keys it does not know go to `reported`.
    pub fn parse(value: Option<&Value>, reported: &mut Vec<String>) -> Result<Option<Self>, ApiError> {
        const P: &str = "repetition_detection";
        let obj = match value {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Object(obj)) => obj,
            Some(other) => {
                return Err(invalid_type(P, format!("`{P}` must be an object, not {}.", kind_of(other))));
            }
        };
        reported.extend(unknown_keys_in(obj, &["max_pattern_size", "min_pattern_size", "min_count"], P));
        let max_size = size(obj, "max_pattern_size")?;
        let min_size = size(obj, "min_pattern_size")?;
        let min_count = size(obj, "min_count")?;
        if min_size > max_size {
            return Err(ApiError::invalid(
                format!("{P}.min_pattern_size"),
                format!(
                    "`{P}.min_pattern_size` ({min_size}) must not exceed `max_pattern_size` ({max_size}); set \
                     `max_pattern_size` to 0 (or leave the object out) to turn detection off."
                ),
            ));
        }
        if max_size == 0 {
            // (off, as vLLM reads it; a count beside it does nothing, which the client is told)
            if min_count > 0 {
                reported.push(P.to_string());
            }
            return Ok(None);
        }
        if min_count < 2 {
            return Err(ApiError::invalid(
                format!("{P}.min_count"),
                format!("`{P}.min_count` must be at least 2 (a pattern seen once is no repetition), got {min_count}."),
            ));
        }
        Ok(Some(Self { min_size: min_size.max(1), max_size, min_count }))
    }

    /// Whether `tokens`, a choice's output so far, ends in `min_count` back-to-back copies of
    /// one pattern of `min_size ..= max_size` tokens. Costs, per length tried, one comparison
    /// per token up to the first that differs; lengths whose copies would not fit are not tried.
    pub fn ends_in_repetition(&self, tokens: &[u32]) -> bool {
        let (count, n) = (self.min_count as usize, tokens.len());
        for k in self.min_size as usize..=self.max_size as usize {
            let Some(span) = k.checked_mul(count).filter(|&span| span <= n) else { return false };
            let tail = &tokens[n - span..];
            // `count` copies of a k-token pattern: every token equals the one k before it
            if (k..span).rev().all(|i| tail[i] == tail[i - k]) {
                return true;
            }
        }
        false
    }
}

/// One sequence under a [`RepetitionDetection`]: its tokens so far, and whether the last one
/// ended them in a repetition.
#[derive(Clone, Debug)]
pub struct RepetitionWatch {
    rule: RepetitionDetection,
    /// Tokens a sequence makes before repetition is looked for (`min_tokens`, as vLLM).
    after: usize,
    tokens: Vec<u32>,
}

impl RepetitionWatch {
    pub fn new(rule: RepetitionDetection, min_tokens: u32) -> Self {
        Self { rule, after: min_tokens as usize, tokens: Vec::new() }
    }

    /// Takes the sequence's next token: whether the output now ends in a repetition.
    pub fn push(&mut self, id: u32) -> bool {
        self.tokens.push(id);
        self.tokens.len() >= self.after && self.rule.ends_in_repetition(&self.tokens)
    }
}

fn size(obj: &Map<String, Value>, key: &str) -> Result<u32, ApiError> {
    let p = format!("repetition_detection.{key}");
    match obj.get(key) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::Number(x)) => match x.as_u64() {
            Some(v) => u32::try_from(v)
                .map_err(|_| ApiError::invalid(&p, format!("`{p}` must be at most {}, got {v}.", u32::MAX))),
            None if x.as_i64().is_some() => Err(ApiError::invalid(&p, format!("`{p}` must not be negative, got {x}."))),
            None => Err(invalid_type(&p, format!("`{p}` must be an integer, got {x}."))),
        },
        Some(other) => Err(invalid_type(&p, format!("`{p}` must be an integer, not {}.", kind_of(other)))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn on(min_size: u32, max_size: u32, min_count: u32) -> RepetitionDetection {
        RepetitionDetection { min_size, max_size, min_count }
    }

    #[test]
    fn a_pattern_repeated_back_to_back_at_the_end() {
        let d = on(1, 3, 3);
        assert!(d.ends_in_repetition(&[9, 7, 7, 7]));
        assert!(!d.ends_in_repetition(&[7, 7]));
        // 1 2 three times
        assert!(d.ends_in_repetition(&[5, 1, 2, 1, 2, 1, 2]));
        assert!(!d.ends_in_repetition(&[5, 1, 2, 1, 2, 1]));
        // 1 2 3 three times; not 1 2 3 4
        assert!(d.ends_in_repetition(&[1, 2, 3, 1, 2, 3, 1, 2, 3]));
        assert!(!on(1, 3, 2).ends_in_repetition(&[1, 2, 3, 4, 1, 2, 3, 4]));
        assert!(on(4, 4, 2).ends_in_repetition(&[1, 2, 3, 4, 1, 2, 3, 4]));
        // copies that are not at the end, or not back to back, do not count
        assert!(!d.ends_in_repetition(&[7, 7, 7, 1]));
        assert!(!d.ends_in_repetition(&[1, 2, 0, 1, 2, 0, 1, 2, 9]));
        assert!(!d.ends_in_repetition(&[1, 2, 1, 2, 5, 1, 2]));
        assert!(!d.ends_in_repetition(&[]));
    }

    #[test]
    fn only_the_lengths_in_range_count() {
        // a run of one token is also a run of its pairs: min 2 still sees it, as pairs
        assert!(on(2, 2, 3).ends_in_repetition(&[7; 6]));
        assert!(!on(2, 2, 3).ends_in_repetition(&[7; 5]));
        // 1 2 repeated, but only length 3 is looked for
        assert!(!on(3, 3, 2).ends_in_repetition(&[1, 2, 1, 2, 1, 2, 1]));
        // a huge range costs nothing past the lengths that fit
        assert!(!on(1, u32::MAX, u32::MAX).ends_in_repetition(&[7; 100]));
        assert!(on(1, u32::MAX, 100).ends_in_repetition(&[7; 100]));
    }

    #[test]
    fn a_watch_looks_once_min_tokens_have_come() {
        let mut w = RepetitionWatch::new(on(1, 1, 3), 5);
        let fired: Vec<bool> = [7; 6].iter().map(|&t| w.push(t)).collect();
        assert_eq!(fired, [false, false, false, false, true, true]);
        let mut w = RepetitionWatch::new(on(1, 1, 3), 0);
        assert_eq!([7, 7, 7].map(|t| w.push(t)), [false, false, true]);
    }

    #[test]
    fn parse_validates_as_vllm() {
        let parse = |v: Value| RepetitionDetection::parse(Some(&v), &mut Vec::new());
        let ok = parse(json!({"max_pattern_size": 4, "min_count": 3})).unwrap();
        assert_eq!(ok, Some(on(1, 4, 3)));
        assert_eq!(
            parse(json!({"max_pattern_size": 4, "min_pattern_size": 2, "min_count": 2})).unwrap(),
            Some(on(2, 4, 2))
        );
        // off: max 0, with or without the others (a count beside it does nothing: reported)
        assert_eq!(parse(json!({})).unwrap(), None);
        assert_eq!(parse(json!({"min_count": 5})).unwrap(), None);
        let mut reported = Vec::new();
        RepetitionDetection::parse(Some(&json!({"min_count": 5})), &mut reported).unwrap();
        assert_eq!(reported, ["repetition_detection"]);
        RepetitionDetection::parse(Some(&json!({"max_pattern_size": 0, "min_count": 0})), &mut reported).unwrap();
        assert_eq!(reported.len(), 1);
        assert_eq!(parse(json!({"max_pattern_size": 0, "min_pattern_size": null})).unwrap(), None);
        assert_eq!(RepetitionDetection::parse(Some(&Value::Null), &mut Vec::new()).unwrap(), None);
        let param = |v: Value| parse(v).unwrap_err().param().map(String::from);
        let min = Some("repetition_detection.min_pattern_size".to_string());
        assert_eq!(param(json!({"min_pattern_size": 2})), min);
        assert_eq!(param(json!({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2})), min);
        let count = Some("repetition_detection.min_count".to_string());
        assert_eq!(param(json!({"max_pattern_size": 2})), count);
        assert_eq!(param(json!({"max_pattern_size": 2, "min_count": 1})), count);
        let max = Some("repetition_detection.max_pattern_size".to_string());
        for bad in [json!(-1), json!(1.5), json!("3"), json!(1u64 << 32)] {
            assert_eq!(param(json!({"max_pattern_size": bad, "min_count": 2})), max, "{bad}");
        }
        assert_eq!(param(json!([2, 3])), Some("repetition_detection".to_string()));
        let mut reported = Vec::new();
        RepetitionDetection::parse(Some(&json!({"max_pattern_size": 1, "min_count": 2, "x": 1})), &mut reported)
            .unwrap();
        assert_eq!(reported, ["repetition_detection.x"]);
    }
}
