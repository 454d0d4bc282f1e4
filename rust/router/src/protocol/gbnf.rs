//! GBNF grammars (llama.cpp's, and the EBNF of vLLM's default backend, xgrammar: `root ::=
//! ...`) written as the Lark grammars the grammar engine compiles, so a grammar from vLLM's
//! documentation is served as sent.
//!
//! The rules keep their order, their alternatives, sequences, groups and repetitions (`*`, `+`,
//! `?`, `{m}`, `{m,}`, `{m,n}`, which the engine's Lark takes as they are); strings become Lark
//! strings and character classes and `.` regexes, each decoded and written again with Lark's
//! escapes; rule names become Lark's (lowercase, starting with a letter, kept distinct), and
//! `start: root` opens the grammar. Comments (`#`) are dropped. What is not GBNF (an unclosed
//! string, a stray character, a rule used but never defined) is a 400 saying where, in the
//! client's text; the engine checks the rest as it checks a Lark grammar.

use std::collections::{HashMap, HashSet};
use std::fmt::Write;

/// Whether `text` is a GBNF grammar: its first definition is `name ::=` (a Lark grammar's is
/// `name:`).
pub fn is_gbnf(text: &str) -> bool {
    let mut rest = text;
    loop {
        rest = rest.trim_start();
        match rest.strip_prefix('#') {
            Some(comment) => rest = comment.split_once('\n').map_or("", |(_, after)| after),
            None => break,
        }
    }
    let name_end = rest.find(|c: char| !is_name_char(c)).unwrap_or(rest.len());
    name_end > 0 && rest[name_end..].trim_start_matches([' ', '\t']).starts_with("::=")
}

/// `gbnf` as a Lark grammar, or why it is not GBNF (with its line and column).
pub fn to_lark(gbnf: &str) -> Result<String, String> {
    let tokens = lex(gbnf)?;
    // each rule: its name, then its body up to the next `name ::=`
    let mut rules: Vec<(&str, &[Tok])> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let (Tok::Name(name, _), Some(Tok::Defines)) = (&tokens[i], tokens.get(i + 1)) else {
            return Err(format!("expected a rule (`name ::= ...`) at {}", tokens[i].at()));
        };
        let body = i + 2;
        let mut end = body;
        while end < tokens.len()
            && !(matches!(tokens[end], Tok::Name(..)) && tokens.get(end + 1) == Some(&Tok::Defines))
        {
            if tokens[end] == Tok::Defines {
                return Err(format!("`::=` without a rule name before it, in rule `{name}`"));
            }
            end += 1;
        }
        if body == end {
            return Err(format!("rule `{name}` is empty"));
        }
        rules.push((name, &tokens[body..end]));
        i = end;
    }
    if !rules.iter().any(|(name, _)| *name == "root") {
        return Err("it has no `root` rule, where a GBNF grammar starts".into());
    }
    let names = lark_names(rules.iter().map(|(name, _)| *name));
    for (name, body) in &rules {
        if let Some(Tok::Name(used, at)) =
            body.iter().find(|t| matches!(t, Tok::Name(n, _) if !names.contains_key(n.as_str())))
        {
            return Err(format!("rule `{name}` uses `{used}` (line {}, column {}), which no rule defines", at.0, at.1));
        }
    }
    let mut lark = format!("start: {}\n", names["root"]);
    for (name, body) in rules {
        let _ = write!(lark, "{}:", names[name]);
        let mut depth = 0usize;
        for token in body {
            lark.push(' ');
            match token {
                Tok::Name(n, _) => lark.push_str(&names[n.as_str()]),
                Tok::Text(s) => lark.push_str(&lark_string(s)),
                Tok::Class(negated, items) => lark.push_str(&lark_class(*negated, items)),
                Tok::Any => lark.push_str("/(?s:.)/"),
                Tok::Punct(c) => {
                    match c {
                        '(' => depth += 1,
                        ')' if depth == 0 => return Err(format!("an unopened `)` in rule `{name}`")),
                        ')' => depth -= 1,
                        '*' | '+' | '?' => {
                            lark.pop(); // (a repetition follows what it repeats)
                        }
                        _ => {}
                    }
                    lark.push(*c);
                }
                Tok::Repeat(r) => {
                    lark.pop();
                    lark.push_str(r);
                }
                Tok::Defines => unreachable!("rule bodies hold no `::=`"),
            }
        }
        if depth > 0 {
            return Err(format!("an unclosed `(` in rule `{name}`"));
        }
        lark.push('\n');
    }
    Ok(lark)
}

#[derive(Debug, PartialEq)]
enum Tok {
    /// A rule name, and where it is (line, column).
    Name(String, (usize, usize)),
    Defines,
    /// A string's characters.
    Text(String),
    /// A character class: negated, and its items (a range of one character for a single one).
    Class(bool, Vec<(char, char)>),
    /// `.`: any character.
    Any,
    /// `|`, `(`, `)`, `*`, `+`, `?`.
    Punct(char),
    /// `{m}`, `{m,}`, `{m,n}`.
    Repeat(String),
}

impl Tok {
    fn at(&self) -> String {
        match self {
            Tok::Name(name, (line, col)) => format!("line {line}, column {col} (`{name}`)"),
            other => format!("{other:?}"),
        }
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

fn lex(text: &str) -> Result<Vec<Tok>, String> {
    let mut tokens = Vec::new();
    let mut chars = text.char_indices().peekable();
    let where_ = |at: usize| {
        let line = text[..at].matches('\n').count() + 1;
        let col = text[text[..at].rfind('\n').map_or(0, |n| n + 1)..at].chars().count() + 1;
        (line, col)
    };
    let error = |at: usize, what: &str| {
        let (line, col) = where_(at);
        format!("{what} at line {line}, column {col}")
    };
    while let Some((at, c)) = chars.next() {
        match c {
            c if c.is_whitespace() => {}
            '#' => while chars.next_if(|(_, c)| *c != '\n').is_some() {},
            ':' => {
                if !(chars.next_if(|(_, c)| *c == ':').is_some() && chars.next_if(|(_, c)| *c == '=').is_some()) {
                    return Err(error(at, "a `:` that does not begin `::=`"));
                }
                tokens.push(Tok::Defines);
            }
            '"' => {
                let mut s = String::new();
                loop {
                    match chars.next() {
                        None => return Err(error(at, "an unclosed string")),
                        Some((_, '"')) => break,
                        Some((e, '\\')) => s.push(escape(&mut chars).ok_or_else(|| error(e, "a bad escape"))?),
                        Some((_, c)) => s.push(c),
                    }
                }
                tokens.push(Tok::Text(s));
            }
            '[' => {
                let negated = chars.next_if(|(_, c)| *c == '^').is_some();
                let mut items = Vec::new();
                loop {
                    let first = match chars.next() {
                        None => return Err(error(at, "an unclosed character class")),
                        Some((_, ']')) => break,
                        Some((e, '\\')) => escape(&mut chars).ok_or_else(|| error(e, "a bad escape"))?,
                        Some((_, c)) => c,
                    };
                    let last = if chars.peek().is_some_and(|(_, c)| *c == '-')
                        && chars.clone().nth(1).is_some_and(|(_, c)| c != ']')
                    {
                        chars.next();
                        match chars.next() {
                            Some((e, '\\')) => escape(&mut chars).ok_or_else(|| error(e, "a bad escape"))?,
                            Some((_, c)) => c,
                            None => return Err(error(at, "an unclosed character class")),
                        }
                    } else {
                        first
                    };
                    if last < first {
                        return Err(error(at, "a character range that runs backwards"));
                    }
                    items.push((first, last));
                }
                if items.is_empty() {
                    return Err(error(at, "an empty character class"));
                }
                tokens.push(Tok::Class(negated, items));
            }
            '{' => {
                let mut r = String::from("{");
                loop {
                    match chars.next() {
                        Some((_, '}')) => break,
                        Some((_, c)) if c.is_ascii_digit() || c == ',' || c == ' ' => {
                            if c != ' ' {
                                r.push(c);
                            }
                        }
                        _ => return Err(error(at, "a repetition that is not `{m}`, `{m,}` or `{m,n}`")),
                    }
                }
                r.push('}');
                let valid = match r[1..r.len() - 1].split_once(',') {
                    None => !r[1..r.len() - 1].is_empty(),
                    Some((m, n)) => !m.is_empty() && !n.contains(','),
                };
                if !valid {
                    return Err(error(at, "a repetition that is not `{m}`, `{m,}` or `{m,n}`"));
                }
                tokens.push(Tok::Repeat(r));
            }
            '.' => tokens.push(Tok::Any),
            '|' | '(' | ')' | '*' | '+' | '?' => tokens.push(Tok::Punct(c)),
            c if is_name_char(c) => {
                let mut name = String::from(c);
                while let Some((_, c)) = chars.next_if(|(_, c)| is_name_char(*c)) {
                    name.push(c);
                }
                tokens.push(Tok::Name(name, where_(at)));
            }
            other => return Err(error(at, &format!("an unexpected {other:?}"))),
        }
    }
    Ok(tokens)
}

/// The character an escape stands for, its backslash read: GBNF's `\n`, `\r`, `\t`, `\xHH`,
/// `\uHHHH`, `\UHHHHHHHH`, or the character itself (`\\`, `\"`, `\]`, `\[`, `\-`, ...).
fn escape(chars: &mut std::iter::Peekable<std::str::CharIndices<'_>>) -> Option<char> {
    let hex = |chars: &mut std::iter::Peekable<std::str::CharIndices<'_>>, n: usize| {
        let digits: String =
            (0..n).map_while(|_| chars.next_if(|(_, c)| c.is_ascii_hexdigit()).map(|(_, c)| c)).collect();
        (digits.len() == n).then(|| u32::from_str_radix(&digits, 16).ok().and_then(char::from_u32)).flatten()
    };
    match chars.next()?.1 {
        'n' => Some('\n'),
        'r' => Some('\r'),
        't' => Some('\t'),
        'x' => hex(chars, 2),
        'u' => hex(chars, 4),
        'U' => hex(chars, 8),
        c => Some(c),
    }
}

/// Lark names for `names` (in order): lowercase, `_` for what Lark's names do not hold, a
/// letter first, and distinct from each other and from `start`.
fn lark_names<'a>(names: impl Iterator<Item = &'a str>) -> HashMap<&'a str, String> {
    let mut taken: HashSet<String> = HashSet::from(["start".to_string()]);
    let mut out = HashMap::new();
    for name in names {
        if out.contains_key(name) {
            continue;
        }
        let mut base: String = name.chars().map(|c| if c == '-' { c } else { c.to_ascii_lowercase() }).collect();
        if !base.starts_with(|c: char| c.is_ascii_lowercase()) {
            base.insert_str(0, "r_");
        }
        let mut lark = base.clone();
        let mut n = 2;
        while !taken.insert(lark.clone()) {
            lark = format!("{base}_{n}");
            n += 1;
        }
        out.insert(name, lark);
    }
    out
}

/// `s` as a Lark string literal: JSON's (Lark's strings are), with DEL escaped too.
fn lark_string(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize").replace('\x7f', "\\u007f")
}

/// A character class as a Lark regex.
fn lark_class(negated: bool, items: &[(char, char)]) -> String {
    let one = |c: char| {
        if c.is_ascii_alphanumeric() || (!c.is_ascii() && !c.is_control()) {
            c.to_string()
        } else {
            format!("\\x{{{:x}}}", c as u32)
        }
    };
    let mut out = String::from(if negated { "/[^" } else { "/[" });
    for &(first, last) in items {
        out.push_str(&one(first));
        if last != first {
            out.push('-');
            out.push_str(&one(last));
        }
    }
    out.push_str("]/");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_is_told_from_lark() {
        assert!(is_gbnf("root ::= \"a\""));
        assert!(is_gbnf("# a comment\n\n  root-rule\t::= x\nx ::= \"a\""));
        assert!(!is_gbnf("start: \"a\""));
        assert!(!is_gbnf("start: \"::=\""));
        assert!(!is_gbnf(""));
    }

    #[test]
    fn vllms_documented_sql_grammar_is_written_as_lark() {
        let gbnf = r#"
            root ::= select_statement
            select_statement ::= "SELECT " column " from " table " where " condition
            column ::= "col_1 " | "col_2 "
            table ::= "table_1 " | "table_2 "
            condition ::= column "= " number
            number ::= "1 " | "2 "
        "#;
        let lark = to_lark(gbnf).unwrap();
        assert_eq!(
            lark,
            "start: root\nroot: select_statement\n\
             select_statement: \"SELECT \" column \" from \" table \" where \" condition\n\
             column: \"col_1 \" | \"col_2 \"\ntable: \"table_1 \" | \"table_2 \"\n\
             condition: column \"= \" number\nnumber: \"1 \" | \"2 \"\n"
        );
    }

    #[test]
    fn classes_strings_repeats_and_names_are_carried_over() {
        let gbnf =
            "root ::= Item (\",\" Item){0,3} ws? # a list\nItem ::= [a-zA-Z_] [^\\]\"/]* \"\\x41\\u00e9\\n\" .\n\
                    ws ::= [ \\t\\n]+ | \"\\\"\"{2}\nr2 ::= ws{1,}";
        let lark = to_lark(gbnf).unwrap();
        assert_eq!(
            lark,
            "start: root\nroot: item ( \",\" item ){0,3} ws?\n\
             item: /[a-zA-Z\\x{5f}]/ /[^\\x{5d}\\x{22}\\x{2f}]/* \"A\u{e9}\\n\" /(?s:.)/\n\
             ws: /[\\x{20}\\x{9}\\x{a}]/+ | \"\\\"\"{2}\nr2: ws{1,}\n"
        );
        // control characters and DEL, which a Lark string may not hold as they are
        assert_eq!(to_lark("root ::= \"\\x01\\x7f\"").unwrap(), "start: root\nroot: \"\\u0001\\u007f\"\n");
        // names Lark cannot hold, or that meet once lowercased
        let lark = to_lark("root ::= A a 9x start\nA ::= \"1\"\na ::= \"2\"\n9x ::= \"3\"\nstart ::= \"4\"").unwrap();
        assert!(
            lark.starts_with(
                "start: root\nroot: a a_2 r_9x start_2\na: \"1\"\na_2: \"2\"\nr_9x: \"3\"\nstart_2: \"4\"\n"
            ),
            "{lark}"
        );
    }

    #[test]
    fn what_is_not_gbnf_is_told_where() {
        for (bad, what) in [
            ("root ::= \"a", "an unclosed string at line 1, column 10"),
            ("root ::= [a-", "an unclosed character class"),
            ("root ::= [z-a]", "runs backwards"),
            ("root ::= []", "an empty character class"),
            ("root ::= \"é\"\nx ::= a $ é", "an unexpected '$' at line 2, column 9"),
            ("root ::= \"a\"{x}", "a repetition"),
            ("root ::= (\"a\"", "an unclosed `(` in rule `root`"),
            ("root ::= \"a\")", "an unopened `)`"),
            ("x ::= \"a\"", "no `root` rule"),
            ("root ::=\nx ::= \"a\"", "rule `root` is empty"),
            ("root ::= \"\\q\" \"\\x4\"", "a bad escape at line 1, column 16"),
            ("root ::= \"yes\" |\n  x", "rule `root` uses `x` (line 2, column 3), which no rule defines"),
        ] {
            let err = to_lark(bad).unwrap_err();
            assert!(err.contains(what), "{bad:?}: {err}");
        }
    }
}
