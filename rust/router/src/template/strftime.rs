//! `strftime_now(fmt)`: Python's `datetime.now().strftime(fmt)` (a naive local time, glibc's
//! directives) on chrono.
//!
//! Each directive is cut out of the format and handled on its own: Python's own (`%f` as 6
//! digits, `%z` and `%Z` empty for a naive time), glibc's C-locale ones that chrono writes
//! the same way, with glibc's `^` (upper case), `#` (swap case of names) and `E`/`O`
//! (alternative forms, the same in the C locale) modifiers; anything else, chrono's own
//! extensions (`%:z`, `%+`, `%.3f`) included, is copied through as glibc copies a directive
//! it does not know. Field widths (`%5d`) are not glibc's: copied through. NOTE: Python
//! 3.12 writes `%:z` itself (empty for a naive time); 3.11 and this copy it through.

use chrono::format::{Item, StrftimeItems};
use chrono::{DateTime, Local, Timelike};

/// The conversions chrono writes as glibc does in the C locale.
const SAME_AS_GLIBC: &str = "aAbBcCdDeFgGhHIjklmMnpPrRsStTuUVwWxXyY%";

pub fn strftime_now(fmt: String) -> String {
    format(&Local::now(), &fmt)
}

fn format(now: &DateTime<Local>, fmt: &str) -> String {
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut rest = fmt;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let spec = &rest[at + 1..];
        let flags_len = spec.find(|c| !matches!(c, '_' | '-' | '0' | '^' | '#')).unwrap_or(spec.len());
        let (flags, after) = spec.split_at(flags_len);
        let modifier = after.strip_prefix(['E', 'O']).map(|_| &after[..1]).unwrap_or("");
        let Some(conv) = after[modifier.len()..].chars().next() else {
            // a dangling `%` (or `%E`, `%-`): as written
            out.push_str(&rest[at..]);
            return out;
        };
        let end = at + 1 + flags_len + modifier.len() + conv.len_utf8();
        let directive = &rest[at..end];
        out.push_str(&directive_text(now, flags, conv).unwrap_or_else(|| directive.to_string()));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// One directive, or None for one glibc would copy through.
fn directive_text(now: &DateTime<Local>, flags: &str, conv: char) -> Option<String> {
    let text = match conv {
        'f' => format!("{:06}", now.nanosecond() % 1_000_000_000 / 1000),
        // (Python's datetime.now() has no tzinfo)
        'z' | 'Z' => String::new(),
        c if SAME_AS_GLIBC.contains(c) => {
            // chrono takes the padding flags itself; glibc's case flags are applied below
            let pad: String = flags.chars().filter(|f| matches!(f, '_' | '-' | '0')).take(1).collect();
            let spec = format!("%{pad}{c}");
            if StrftimeItems::new(&spec).any(|item| matches!(item, Item::Error)) {
                return None;
            }
            now.format(&spec).to_string()
        }
        _ => return None,
    };
    // (glibc's `#` swaps the case of names: day and month names up, am/pm down)
    let swap = flags.contains('#');
    Some(if flags.contains('^') || swap && matches!(conv, 'a' | 'A' | 'b' | 'B' | 'h') {
        text.to_uppercase()
    } else if swap && conv == 'p' {
        text.to_lowercase()
    } else {
        text
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn glibc_directives_and_pass_through() {
        let now = Local.with_ymd_and_hms(2026, 12, 2, 9, 5, 7).unwrap() + chrono::Duration::microseconds(123456);
        let cases = [
            ("%Y-%m-%d %H:%M:%S", "2026-12-02 09:05:07"),
            ("%d %b %Y %", "02 Dec 2026 %"),
            ("%Q %i %K %:z %+ %q %.3f %3f", "%Q %i %K %:z %+ %q %.3f %3f"),
            ("%f|%z|%Z", "123456||"),
            ("%^a %^B %#a %#p %P %^p", "WED DECEMBER WED am am AM"),
            ("%Ey %Oy %OH %-d %_d %e %-y %%", "26 26 09 2  2  2 26 %"),
            ("%E", "%E"),
            ("é%dé", "é02é"),
        ];
        for (fmt, want) in cases {
            assert_eq!(format(&now, fmt), want, "{fmt}");
        }
    }
}
