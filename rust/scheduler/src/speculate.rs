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
    for n in (min_n.max(1)..=max_n).rev() {
        if n >= len {
            continue;
        }
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

#[cfg(test)]
mod tests {
    use super::propose;

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
