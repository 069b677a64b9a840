//! GBNF / EBNF grammars (`root ::= …`, what xgrammar takes) as Lark rules for llguidance.
//!
//! Besides plain GBNF this reads what xgrammar itself prints for a JSON schema
//! (`xgr.Grammar.from_json_schema`), which frontends hand on as the content of a
//! structural tag (Cohere Command's tool calls): repetition ranges `x{m, n}` (`-1`: no
//! upper bound), lookahead assertions `(= …)` after a rule's body, and
//! `Regex("…", json_string=true)` terminals.

use super::lark::lark_regex;

/// A whole GBNF grammar as a Lark grammar: its `root` is Lark's `start`.
pub fn gbnf_to_lark(g: &str) -> Result<String, String> {
    gbnf_rules(g, "g_", "start")
}

/// The rules of a GBNF grammar in Lark, one per line, each name behind `prefix` and
/// `root` named `root_name`: rules that can sit beside others in one Lark grammar.
pub(super) fn gbnf_rules(g: &str, prefix: &str, root_name: &str) -> Result<String, String> {
    // Lark rule names are lower case: `_` is written `__`, `-` `_d` and a capital `X`
    // `_ux`, so that distinct GBNF names (`a-b` and `a_b`, `A` and `a`) stay distinct
    let name_of = |n: &str| -> String {
        if n == "root" {
            return root_name.into();
        }
        let mut out = String::from(prefix);
        for c in n.chars() {
            match c {
                '_' => out.push_str("__"),
                '-' => out.push_str("_d"),
                c if c.is_ascii_uppercase() => {
                    out.push_str("_u");
                    out.push(c.to_ascii_lowercase());
                }
                c => out.push(c),
            }
        }
        out
    };
    let mut out = String::new();
    let chars: Vec<char> = g.chars().collect();
    let mut i = 0;
    let mut saw_rule = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '"' => {
                let end = string_end(&chars, i);
                out.extend(&chars[i..end]);
                i = end;
            }
            '[' => {
                let end = class_end(&chars, i);
                let class: String = chars[i..end].iter().collect();
                out.push('/');
                out.push_str(&lark_regex(&octal_nul(&class)));
                out.push('/');
                i = end;
            }
            '{' => {
                let close = chars[i..]
                    .iter()
                    .position(|&c| c == '}')
                    .ok_or("a repetition range `{` has no `}`")?;
                let range: String = chars[i + 1..i + close].iter().collect();
                out.push_str(&repetition(&range)?);
                i += close + 1;
            }
            '(' if next_non_blank(&chars, i + 1) == Some('=') => {
                // a lookahead assertion: it only narrows what may follow, which the rules
                // after it say already
                i = group_end(&chars, i);
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == '-')
                {
                    i += 1;
                }
                let name: String = chars[start..i].iter().collect();
                if name == "Regex" && next_non_blank(&chars, i) == Some('(') {
                    let (rx, end) = regex_call(&chars, i)?;
                    out.push('/');
                    out.push_str(&lark_regex(&rx));
                    out.push('/');
                    i = end;
                    continue;
                }
                let mut j = i;
                while j < chars.len() && (chars[j] == ' ' || chars[j] == '\t') {
                    j += 1;
                }
                let defines = chars[j..].starts_with(&[':', ':', '=']);
                if defines {
                    if saw_rule {
                        out.push('\n');
                    }
                    saw_rule = true;
                    out.push_str(&name_of(&name));
                    out.push(':');
                    i = j + 3;
                } else {
                    out.push_str(&name_of(&name));
                }
            }
            '\n' => {
                out.push(' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    if !saw_rule {
        return Err("no `name ::= …` rule".into());
    }
    out.push('\n');
    Ok(out)
}

/// Past the string literal that opens at `i`.
fn string_end(chars: &[char], i: usize) -> usize {
    delimited_end(chars, i, '"')
}

/// Past the character class that opens at `i`.
fn class_end(chars: &[char], i: usize) -> usize {
    delimited_end(chars, i, ']')
}

/// Past the first unescaped `close` after `i`.
fn delimited_end(chars: &[char], i: usize, close: char) -> usize {
    let mut j = i + 1;
    while j < chars.len() && chars[j] != close {
        if chars[j] == '\\' {
            j += 1;
        }
        j += 1;
    }
    (j + 1).min(chars.len())
}

/// Past the parenthesised group that opens at `i` (strings and classes in it skipped).
fn group_end(chars: &[char], i: usize) -> usize {
    let mut depth = 0usize;
    let mut j = i;
    while j < chars.len() {
        match chars[j] {
            '"' => {
                j = string_end(chars, j);
                continue;
            }
            '[' => {
                j = class_end(chars, j);
                continue;
            }
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
        j += 1;
    }
    chars.len()
}

fn next_non_blank(chars: &[char], i: usize) -> Option<char> {
    chars[i.min(chars.len())..]
        .iter()
        .copied()
        .find(|c| !matches!(c, ' ' | '\t'))
}

/// xgrammar's `{m, n}` as Lark's (`-1`: unbounded).
fn repetition(range: &str) -> Result<String, String> {
    let bad = || format!("`{{{range}}}` is not a repetition range `{{m, n}}`");
    let bound = |s: &str| s.trim().parse::<i64>().map_err(|_| bad());
    let (lo, hi) = match range.split_once(',') {
        Some((lo, hi)) => (bound(lo)?, bound(hi)?),
        None => {
            let n = bound(range)?;
            (n, n)
        }
    };
    if lo < 0 || hi < -1 || (hi >= 0 && hi < lo) || lo > i64::from(i32::MAX) {
        return Err(bad());
    }
    Ok(match (lo, hi) {
        (0, -1) => "*".into(),
        (1, -1) => "+".into(),
        (lo, -1) => format!("{{{lo},}}"),
        // llguidance refuses an upper bound of 0: the item is absent
        (_, 0) => "{0,1}".into(),
        (lo, hi) => format!("{{{lo},{hi}}}"),
    })
}

/// `Regex("pattern", …)` at `i` (the name's end): the pattern without its anchors, and
/// the position past the call.
fn regex_call(chars: &[char], i: usize) -> Result<(String, usize), String> {
    let open = i + chars[i..].iter().position(|&c| c == '(').unwrap_or(0);
    let end = group_end(chars, open);
    let q = chars[open..end]
        .iter()
        .position(|&c| c == '"')
        .map(|p| open + p)
        .ok_or("`Regex(…)` has no pattern string")?;
    let literal: String = chars[q..string_end(chars, q)].iter().collect();
    let rx: String =
        serde_json::from_str(&literal).map_err(|e| format!("`Regex({literal}…)`: {e}"))?;
    let rx = rx.strip_prefix('^').unwrap_or(&rx);
    let rx = match rx.strip_suffix('$') {
        Some(r) if !r.ends_with('\\') => r,
        _ => rx,
    };
    Ok((rx.to_string(), end))
}

/// `\0` in a class as `\x00`: the regex engine behind llguidance reads no octal escapes.
fn octal_nul(class: &str) -> String {
    let mut out = String::with_capacity(class.len());
    let mut it = class.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\\' {
            match it.next() {
                Some('0') if !it.peek().is_some_and(char::is_ascii_digit) => out.push_str("\\x00"),
                Some(e) => {
                    out.push('\\');
                    out.push(e);
                }
                None => out.push('\\'),
            }
        } else {
            out.push(c);
        }
    }
    out
}
