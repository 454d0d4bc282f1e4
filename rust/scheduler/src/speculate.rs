//! N-gram drafts (prompt lookup): the tokens that followed an earlier occurrence of a
//! sequence's last n tokens, for the longest n that occurs: the latest occurrence that is
//! followed by k tokens, else the earliest (the one followed by the most).
//!
//! Cost: O(len x n) comparisons per n tried, per sequence and step (a few microseconds for a
//! few thousand tokens); nothing is indexed between steps.

/// Up to `k` drafts for `tokens` (prompt + output): for n from `max_n` down to `min_n`, the
/// earlier windows equal to the last n tokens; the latest one followed by k tokens gives
/// them, else the earliest gives the tokens after it. Empty when no n-gram recurs.
pub(crate) fn propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> &[u32] {
    let len = tokens.len();
    if k == 0 {
        return &[];
    }
    for n in (min_n.max(1)..=max_n.min(len.saturating_sub(1))).rev() {
        let tail = &tokens[len - n..];
        // windows starting before len - n: each is followed by at least one token
        let mut earliest = None;
        for i in (0..len - n).rev().filter(|&i| &tokens[i..i + n] == tail) {
            if i + n + k <= len {
                return &tokens[i + n..i + n + k];
            }
            earliest = Some(i);
        }
        if let Some(i) = earliest {
            return &tokens[i + n..];
        }
    }
    &[]
}

/// The longest run of a sequence's last output tokens that `from_prediction` aligns.
const MAX_ALIGN: usize = 16;

/// Up to `k` drafts from a predicted output (OpenAI's `prediction`) for a sequence that has
/// generated `output`: the tokens after the place in `prediction` where the output's last
/// tokens are. That place is where the longest run of them (up to MAX_ALIGN) ends in the
/// prediction, of equally long ones the nearest to the output's own length (an edited copy
/// stays near its place). The prediction's first tokens while there is no output. Empty when
/// the output's last token is nowhere in the prediction, or only at its end.
pub(crate) fn from_prediction<'a>(prediction: &'a [u32], output: &[u32], k: usize) -> &'a [u32] {
    let Some(&last) = output.last() else {
        return &prediction[..k.min(prediction.len())];
    };
    // (run length, where it ends in the prediction)
    let mut best: Option<(usize, usize)> = None;
    for (i, _) in prediction.iter().enumerate().filter(|&(_, &t)| t == last) {
        let run = 1
            + (1..MAX_ALIGN.min(output.len()).min(i + 1))
                .take_while(|&l| prediction[i - l] == output[output.len() - 1 - l])
                .count();
        let end = i + 1;
        let better =
            best.is_none_or(|(r, e)| run > r || (run == r && end.abs_diff(output.len()) < e.abs_diff(output.len())));
        if better {
            best = Some((run, end));
        }
    }
    best.map_or(&[], |(_, end)| &prediction[end..(end + k).min(prediction.len())])
}

#[cfg(test)]
mod tests {
    use super::{from_prediction, propose};

    #[test]
    fn a_prediction_drafts_from_where_the_output_is() {
        //               0  1  2  3  4  5  6  7  8  9
        let predicted = [5, 6, 7, 8, 5, 6, 9, 8, 5, 6];
        // nothing yet: its start
        assert_eq!(from_prediction(&predicted, &[], 3), &[5, 6, 7]);
        // the output so far is its start: what follows
        assert_eq!(from_prediction(&predicted, &[5, 6], 3), &[7, 8, 5]);
        // "8 5 6" ends at 6 and at 10: the longer run decides ("7 8 5 6" only at 6)
        assert_eq!(from_prediction(&predicted, &[7, 8, 5, 6], 2), &[9, 8]);
        // the run "9 8 5 6" ends the prediction: nothing follows
        assert_eq!(from_prediction(&predicted, &[1, 1, 1, 1, 1, 9, 8, 5, 6], 2), &[] as &[u32]);
        // equal runs ("8 5" ends at 5 and at 9): the place nearest the output's length
        assert_eq!(from_prediction(&predicted, &[1, 1, 8, 5], 3), &[6, 9, 8]);
        assert_eq!(from_prediction(&predicted, &[1, 1, 1, 1, 1, 1, 1, 8, 5], 3), &[6]);
        // an edit: the output's last token is not in the prediction
        assert_eq!(from_prediction(&predicted, &[5, 6, 42], 3), &[] as &[u32]);
        assert_eq!(from_prediction(&[], &[5], 3), &[] as &[u32]);
    }

    #[test]
    fn drafts_follow_the_latest_longest_match() {
        //            0  1  2  3  4  5  6  7  8  9
        let tokens = [1, 2, 3, 9, 1, 2, 4, 5, 1, 2];
        // "1 2" last occurred at 4: it was followed by 4 5 1
        assert_eq!(propose(&tokens, 1, 2, 3), &[4, 5, 1]);
        // a longer n-gram wins: "9 1 2" ... no 3-gram recurs, so n = 2 as above
        assert_eq!(propose(&tokens, 1, 3, 3), &[4, 5, 1]);
        // only n = 3 allowed: nothing
        assert_eq!(propose(&tokens, 3, 3, 3), &[] as &[u32]);
        // k clips; short of k tokens after every match, the earliest match's run to the end
        assert_eq!(propose(&tokens, 1, 2, 1), &[4]);
        assert_eq!(propose(&[7, 8, 7], 1, 1, 5), &[8, 7]);
        assert_eq!(propose(&tokens, 1, 2, 8), &[3, 9, 1, 2, 4, 5, 1, 2]);
    }

    #[test]
    fn longest_n_first() {
        // "3 1" (n = 2) occurs at 2 followed by 7; "1" (n = 1) last occurs at 5, followed by 8
        let tokens = [5, 6, 3, 1, 7, 1, 8, 3, 1];
        assert_eq!(propose(&tokens, 1, 2, 2), &[7, 1]);
        assert_eq!(propose(&tokens, 1, 1, 2), &[8, 3]);
    }

    #[test]
    fn nothing_to_propose() {
        assert_eq!(propose(&[], 1, 3, 4), &[] as &[u32]);
        assert_eq!(propose(&[1], 1, 3, 4), &[] as &[u32]);
        assert_eq!(propose(&[1, 2, 3, 4], 1, 3, 4), &[] as &[u32]);
        assert_eq!(propose(&[1, 1], 1, 3, 0), &[] as &[u32]);
        // a run of one token drafts more of it
        assert_eq!(propose(&[4, 4, 4, 4, 4], 1, 2, 2), &[4, 4]);
        assert_eq!(propose(&[4, 4, 4, 4], 1, 2, 3), &[4, 4]);
    }
}
