//! The GPT-4-family `Split` pre-tokenizer (Qwen2/3, Llama 3, ...) without backtracking.
//!
//! The patterns end with `\s+(?!\S)|\s+`; the look-ahead is the only thing that needs
//! `fancy-regex`'s backtracking VM, which spends ~20 ms on an 8k-token prompt. Here the regex
//! without it (`...|\s+`) runs on the `regex` crate's automata and the look-ahead becomes a
//! rule on the match: a whitespace run of two or more characters followed by a non-space gives
//! its last character back to the next piece. For the two patterns in wide use, ASCII text is
//! cut by a hand-written scanner of the same rules (most prompts are ASCII); it answers only
//! when every byte it looks at is ASCII, and the regex takes the piece otherwise. Tests check
//! the scanner against the regex and both against `tokenizers` on random text.

/// The look-ahead alternatives every supported pattern ends with, and their replacement.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";
const PLAIN_TAIL: &str = r"|\s+";

/// Qwen2/3's pattern (one digit a piece) and Llama 3's / cl100k's (up to three), without the
/// tail: the ones the ASCII scanner knows.
const QWEN_HEAD: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+";
const LLAMA3_HEAD: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+";

/// A split pattern run without backtracking.
#[derive(Debug)]
pub(crate) struct Splitter {
    regex: regex::Regex,
    /// Most digits in one piece, when the ASCII scanner knows the pattern.
    ascii_digits: Option<usize>,
}

impl Splitter {
    /// A splitter for `pattern`, or `None` when it does not end with the look-ahead tail or
    /// has any other look-around, anchor or word boundary.
    pub(crate) fn new(pattern: &str) -> Option<Splitter> {
        let head = pattern.strip_suffix(LOOKAHEAD_TAIL)?;
        let plain = format!("{head}{PLAIN_TAIL}");
        // A search started at any offset must find what one over the whole text would there:
        // nothing may look at the text around a match. Look-arounds and back-references do
        // not even parse.
        let hir = regex_syntax::parse(&plain).ok()?;
        if !hir.properties().look_set().is_empty() {
            return None;
        }
        let ascii_digits = match head {
            QWEN_HEAD => Some(1),
            LLAMA3_HEAD => Some(3),
            _ => None,
        };
        Some(Splitter {
            regex: regex::Regex::new(&plain).ok()?,
            ascii_digits,
        })
    }

    /// The same pattern with the regex alone (tests compare the two).
    #[cfg(test)]
    fn regex_only(&self) -> Splitter {
        Splitter {
            regex: self.regex.clone(),
            ascii_digits: None,
        }
    }

    /// The pieces of `text`, in order, covering it exactly.
    pub(crate) fn pieces<'t>(&'t self, text: &'t str) -> impl Iterator<Item = &'t str> + 't {
        let mut at = 0;
        std::iter::from_fn(move || {
            if at >= text.len() {
                return None;
            }
            let end = self.piece_end(text, at);
            let piece = &text[at..end];
            at = end;
            Some(piece)
        })
    }

    /// Where the piece starting at `at` (< `text.len()`) ends; always beyond `at`.
    fn piece_end(&self, text: &str, at: usize) -> usize {
        if let Some(end) = self
            .ascii_digits
            .and_then(|d| ascii_piece_end(text.as_bytes(), at, d))
        {
            return end;
        }
        let Some(m) = self.regex.find_at(text, at) else {
            return text.len();
        };
        if m.start() > at {
            // Text no alternative matches is a piece of its own (`Isolated`).
            return m.start();
        }
        if m.is_empty() {
            // An empty match is no piece: the text up to the next real one is.
            let next = at + text[at..].chars().next().map_or(1, char::len_utf8);
            return self
                .regex
                .find_iter(&text[next..])
                .find(|m| !m.is_empty())
                .map_or(text.len(), |m| next + m.start());
        }
        let mut end = m.end();
        let piece = m.as_str();
        // Only the final `\s+` matches whitespace alone without ending in a line break
        // (`\s*[\r\n]+` ends in one; every other alternative holds a non-space).
        if let Some(last) = piece.chars().next_back() {
            let followed_by_text = text[end..]
                .chars()
                .next()
                .is_some_and(|c| !c.is_whitespace());
            if followed_by_text
                && last != '\n'
                && last != '\r'
                && piece.len() > last.len_utf8()
                && piece.chars().all(char::is_whitespace)
            {
                end -= last.len_utf8();
            }
        }
        end
    }
}

/// ASCII classes of the pattern: `\p{L}`, `\p{N}`, `\s` (Unicode `White_Space`), the rest.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Newline,
    Other,
}

/// The class of an ASCII byte; `None` for a byte of a multi-byte character.
fn class(b: u8) -> Option<Class> {
    Some(match b {
        b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
        b'0'..=b'9' => Class::Digit,
        b'\r' | b'\n' => Class::Newline,
        b'\t' | 0x0B | 0x0C | b' ' => Class::Space,
        0x80.. => return None,
        _ => Class::Other,
    })
}

/// The class at `i`: `Some(None)` past the end, `None` for a non-ASCII byte (give up).
fn class_at(b: &[u8], i: usize) -> Option<Option<Class>> {
    match b.get(i) {
        None => Some(None),
        Some(&c) => class(c).map(Some),
    }
}

/// The end of the run of bytes from `i` whose class `keep` accepts; `None` when the byte that
/// ends it is not ASCII (it might belong to the run).
fn run_end(b: &[u8], mut i: usize, keep: impl Fn(Class) -> bool) -> Option<usize> {
    loop {
        match class_at(b, i)? {
            Some(c) if keep(c) => i += 1,
            _ => return Some(i),
        }
    }
}

/// The end of the piece at `at` by the pattern's alternatives, in their order, for ASCII:
/// `None` as soon as a byte the answer depends on is not ASCII.
fn ascii_piece_end(b: &[u8], at: usize, max_digits: usize) -> Option<usize> {
    let first = class_at(b, at)??;
    let second = class_at(b, at + 1);
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if b[at] == b'\'' {
        let one = second??;
        let lower = |i: usize| b.get(i).map(u8::to_ascii_lowercase);
        if one == Class::Letter {
            match lower(at + 1) {
                Some(b's' | b't' | b'm' | b'd') => return Some(at + 2),
                Some(c @ (b'r' | b'v' | b'l')) => {
                    let want = if c == b'l' { b'l' } else { b'e' };
                    // The third byte decides: a non-ASCII one could be a case variant.
                    if class_at(b, at + 2)?.is_some() && lower(at + 2) == Some(want) {
                        return Some(at + 3);
                    }
                }
                _ => {}
            }
        }
    }
    let letters_from = |i: usize| run_end(b, i, |c| c == Class::Letter);
    match first {
        // [^\r\n\p{L}\p{N}]?\p{L}+
        Class::Letter => letters_from(at),
        Class::Digit => {
            // \p{N}{1,d}
            let mut end = at + 1;
            while end - at < max_digits {
                match class_at(b, end)? {
                    Some(Class::Digit) => end += 1,
                    _ => break,
                }
            }
            Some(end)
        }
        Class::Space | Class::Other if second? == Some(Class::Letter) => letters_from(at + 1),
        Class::Other => other_run(b, at),
        Class::Space if b[at] == b' ' && second? == Some(Class::Other) => other_run(b, at + 1),
        Class::Space | Class::Newline => {
            let end = run_end(b, at, |c| matches!(c, Class::Space | Class::Newline))?;
            // \s*[\r\n]+: up to the run's last line break.
            if let Some(last) = b[at..end].iter().rposition(|&c| c == b'\r' || c == b'\n') {
                return Some(at + last + 1);
            }
            // \s+(?!\S)|\s+
            let followed_by_text = end < b.len();
            Some(if followed_by_text && end - at >= 2 {
                end - 1
            } else {
                end
            })
        }
    }
}

/// ` ?[^\s\p{L}\p{N}]+[\r\n]*` from the first byte of the `[^\s\p{L}\p{N}]+` run.
fn other_run(b: &[u8], from: usize) -> Option<usize> {
    let end = run_end(b, from, |c| c == Class::Other)?;
    Some(
        end + b[end..]
            .iter()
            .take_while(|&&c| c == b'\r' || c == b'\n')
            .count(),
    )
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use proptest::prelude::*;

    use super::*;

    fn qwen() -> Splitter {
        Splitter::new(&format!("{QWEN_HEAD}{LOOKAHEAD_TAIL}")).unwrap()
    }

    fn llama3() -> Splitter {
        Splitter::new(&format!("{LLAMA3_HEAD}{LOOKAHEAD_TAIL}")).unwrap()
    }

    fn pieces(s: &Splitter, text: &str) -> Vec<String> {
        s.pieces(text).map(str::to_owned).collect()
    }

    #[test]
    fn only_patterns_without_look_around_after_the_tail_are_taken() {
        assert!(Splitter::new(r"\p{L}+|\s+(?!\S)|\s+").is_some());
        assert!(Splitter::new(r"\p{L}+|\s+").is_none());
        assert!(Splitter::new(r"(?=a)\p{L}+|\s+(?!\S)|\s+").is_none());
        assert!(Splitter::new(r"\b\p{L}+|\s+(?!\S)|\s+").is_none());
        assert!(Splitter::new(r"^\p{L}+|\s+(?!\S)|\s+").is_none());
        assert_eq!(qwen().ascii_digits, Some(1));
        assert_eq!(llama3().ascii_digits, Some(3));
        assert_eq!(
            Splitter::new(r"\p{L}+|\s+(?!\S)|\s+").unwrap().ascii_digits,
            None
        );
    }

    #[test]
    fn hand_worked_pieces() {
        let q = qwen();
        assert_eq!(pieces(&q, "I'm  here"), ["I", "'m", " ", " here"]);
        assert_eq!(
            pieces(&q, "x = 12;\n\n  y"),
            ["x", " =", " ", "1", "2", ";\n\n", " ", " y"]
        );
        assert_eq!(pieces(&q, "  \n \n  z"), ["  \n \n", " ", " z"]);
        assert_eq!(pieces(&q, "end  "), ["end", "  "]);
        assert_eq!(pieces(&q, " 'LL"), [" '", "LL"]);
        assert_eq!(pieces(&q, "'LL"), ["'LL"]);
        assert_eq!(pieces(&llama3(), "12345"), ["123", "45"]);
        assert_eq!(pieces(&q, "naïve"), ["naïve"]);
    }

    /// Characters of every class the pattern tells apart, ASCII and not.
    const ALPHABET: &[&str] = &[
        "a", "Z", "s", "S", "t", "r", "e", "v", "m", "l", "L", "d", "'", "’", "7", "٣", "Ⅷ", " ",
        "\t", "\n", "\r", "\u{b}", "\u{c}", "\u{85}", "\u{a0}", "\u{3000}", ".", ",", "!", "(",
        "-", "é", "\u{301}", "ſ", "K", "中", "한", "👍", "\u{0}", "\u{7f}", "\u{1c}",
    ];

    fn text() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(ALPHABET), 0..60).prop_map(|p| p.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn the_ascii_scanner_cuts_as_the_regex(text in text()) {
            // Compiled once: a regex of Unicode classes takes a while in a debug build.
            static SPLITTERS: OnceLock<[(Splitter, Splitter); 2]> = OnceLock::new();
            let splitters = SPLITTERS.get_or_init(|| {
                [qwen(), llama3()].map(|s| {
                    let regex = s.regex_only();
                    (s, regex)
                })
            });
            for (scanner, regex) in splitters {
                prop_assert_eq!(pieces(scanner, &text), pieces(regex, &text), "{:?}", text);
            }
        }
    }
}
