//! Token intake: token ids from header and metadata strings and from JSON bodies, without
//! building a document tree.
//!
//! One concern: reading token ids and request fields out of client bytes, without a
//! document tree; the JSON scanner and the token-string parser share the number rules.
//!
//! - A header or metadata value is either a decimal comma list (`"1, 2, 3"`) or the base64
//!   (standard or URL-safe alphabet, padding optional) of the tokens as `u32` little-endian.
//!   A value with a comma, or of at most 10 digits, is decimal; anything else is base64.
//! - A JSON body is scanned once, left to right: the fields asked for are extracted (token
//!   arrays parsed into the caller's reused buffer, strings returned as byte ranges), every
//!   other value is skipped with its structure checked. Token arrays must hold integers in
//!   `0..=u32::MAX`: a fraction, an exponent, a sign, a larger number or a non-number makes
//!   the body an error, since guessing would route on the wrong prefix.
//!
//! The tokens go into a caller-owned `Vec<u32>` that is cleared, not reallocated, from one
//! request to the next: the block size that hashing needs may only be known from a field that
//! comes after the prompt (`model`), so the tokens are kept, not hashed, while scanning.

mod digits;
mod window;

use digits::{eight_digits, swar_digits};

/// Why intake failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IntakeError {
    /// Nothing but whitespace.
    #[error("empty value")]
    Empty,
    /// Base64 with a character outside both alphabets, a bad length, or a byte count that is
    /// not a multiple of 4.
    #[error("bad base64 at byte {0}")]
    Base64(usize),
    /// A number with a fraction or exponent, or an array element that is not a number.
    #[error("token at byte {0} is not an integer")]
    NotInteger(usize),
    /// A token with a minus sign.
    #[error("negative token at byte {0}")]
    Negative(usize),
    /// A token above `u32::MAX`.
    #[error("token at byte {0} exceeds u32")]
    TooLarge(usize),
    /// More tokens than the caller allows.
    #[error("more than {0} tokens")]
    TooMany(usize),
    /// Not well-formed JSON at this byte.
    #[error("invalid JSON at byte {0}")]
    Json(usize),
    /// The body is JSON but not an object.
    #[error("JSON body is not an object")]
    NotObject,
    /// Nesting deeper than [`MAX_DEPTH`].
    #[error("JSON nested too deep at byte {0}")]
    TooDeep(usize),
}

/// Deepest nesting the body scanner follows.
pub const MAX_DEPTH: u32 = 128;

/// Parses a header or metadata value into `out` (cleared first).
///
/// # Errors
/// [`IntakeError`] for malformed values or more than `max_tokens` tokens.
pub fn parse_token_string(
    value: &[u8],
    out: &mut Vec<u32>,
    max_tokens: usize,
) -> Result<(), IntakeError> {
    out.clear();
    let v = trim(value);
    if v.is_empty() {
        return Err(IntakeError::Empty);
    }
    // A decimal list starts with a token of 1 to 10 digits followed by its end, a comma or a
    // blank; base64 has neither commas nor blanks. Looking at the head only spares a pass over
    // a 40 KB header.
    let digits = v.iter().take(11).take_while(|b| b.is_ascii_digit()).count();
    let decimal = (1..=10).contains(&digits)
        && v.get(digits)
            .is_none_or(|b| matches!(b, b',' | b' ' | b'\t'));
    if decimal {
        parse_decimal_list(v, out, max_tokens)
    } else {
        decode_base64_u32(v, out, max_tokens)
    }
}

fn trim(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    v.get(start..end).unwrap_or(&[])
}

/// Parses `"1, 2,3"` into `out`.
///
/// # Errors
/// [`IntakeError`] for anything but unsigned integers up to `u32::MAX` separated by commas.
pub fn parse_decimal_list(
    v: &[u8],
    out: &mut Vec<u32>,
    max_tokens: usize,
) -> Result<(), IntakeError> {
    out.clear();
    let mut i = 0;
    let n = v.len();
    loop {
        while i < n && (v[i] == b' ' || v[i] == b'\t') {
            i += 1;
        }
        if i < n && v[i] == b'-' {
            return Err(IntakeError::Negative(i));
        }
        let start = i;
        let mut x: u64 = 0;
        while i < n {
            let d = v[i].wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            x = x * 10 + d as u64;
            if x > u32::MAX as u64 {
                return Err(IntakeError::TooLarge(start));
            }
            i += 1;
        }
        if i == start {
            return Err(IntakeError::NotInteger(start));
        }
        if out.len() >= max_tokens {
            return Err(IntakeError::TooMany(max_tokens));
        }
        out.push(x as u32);
        while i < n && (v[i] == b' ' || v[i] == b'\t') {
            i += 1;
        }
        if i == n {
            return Ok(());
        }
        if v[i] != b',' {
            return Err(IntakeError::NotInteger(i));
        }
        i += 1;
    }
}

const B64_BAD: u8 = 0xff;

const fn b64_table() -> [u8; 256] {
    let mut t = [B64_BAD; 256];
    let mut i = 0;
    while i < 26 {
        t[b'A' as usize + i] = i as u8;
        t[b'a' as usize + i] = 26 + i as u8;
        i += 1;
    }
    let mut d = 0;
    while d < 10 {
        t[b'0' as usize + d] = 52 + d as u8;
        d += 1;
    }
    t[b'+' as usize] = 62;
    t[b'-' as usize] = 62;
    t[b'/' as usize] = 63;
    t[b'_' as usize] = 63;
    t
}

static B64: [u8; 256] = b64_table();

/// Bit 31 of a position table entry: not a base64 character.
const B64_BAD_BIT: u32 = 1 << 31;

const fn b64_shifted(shift: u32) -> [u32; 256] {
    let t = b64_table();
    let mut out = [B64_BAD_BIT; 256];
    let mut i = 0;
    while i < 256 {
        if t[i] != B64_BAD {
            out[i] = (t[i] as u32) << shift;
        }
        i += 1;
    }
    out
}

static B64_0: [u32; 256] = b64_shifted(18);
static B64_1: [u32; 256] = b64_shifted(12);
static B64_2: [u32; 256] = b64_shifted(6);
static B64_3: [u32; 256] = b64_shifted(0);

/// Decodes base64 of little-endian `u32`s into `out`.
///
/// # Errors
/// [`IntakeError::Base64`] on a bad character or length; [`IntakeError::TooMany`].
pub fn decode_base64_u32(
    v: &[u8],
    out: &mut Vec<u32>,
    max_tokens: usize,
) -> Result<(), IntakeError> {
    out.clear();
    let mut s = v;
    while let [rest @ .., b'='] = s {
        s = rest;
    }
    if v.len() - s.len() > 2 || s.len() % 4 == 1 {
        return Err(IntakeError::Base64(s.len()));
    }
    let bytes = s.len() / 4 * 3 + (s.len() % 4).saturating_sub(1);
    if !bytes.is_multiple_of(4) {
        return Err(IntakeError::Base64(s.len()));
    }
    if bytes / 4 > max_tokens {
        return Err(IntakeError::TooMany(max_tokens));
    }
    out.reserve(bytes / 4);
    // 16 characters are 12 bytes are 3 tokens. Each character's 6 bits come pre-shifted
    // from a table per position; bit 31 marks a bad character, checked once per 16.
    let mut chunks = s.chunks_exact(16);
    for (ci, c) in (&mut chunks).enumerate() {
        let quad = |q: usize| {
            B64_0[c[q * 4] as usize]
                | B64_1[c[q * 4 + 1] as usize]
                | B64_2[c[q * 4 + 2] as usize]
                | B64_3[c[q * 4 + 3] as usize]
        };
        let (w0, w1, w2, w3) = (quad(0), quad(1), quad(2), quad(3));
        if (w0 | w1 | w2 | w3) & B64_BAD_BIT != 0 {
            return Err(IntakeError::Base64(ci * 16));
        }
        // Bytes in order: w0 >> 16, w0 >> 8, w0, w1 >> 16, ... (each word holds 3 bytes).
        let b = |w: u32, k: u32| (w >> (16 - 8 * k)) & 0xff;
        let t0 = b(w0, 0) | b(w0, 1) << 8 | b(w0, 2) << 16 | b(w1, 0) << 24;
        let t1 = b(w1, 1) | b(w1, 2) << 8 | b(w2, 0) << 16 | b(w2, 1) << 24;
        let t2 = b(w2, 2) | b(w3, 0) << 8 | b(w3, 1) << 16 | b(w3, 2) << 24;
        out.extend_from_slice(&[t0, t1, t2]);
    }
    // Tail: fewer than 16 characters, decoded bitwise.
    let tail = chunks.remainder();
    let base = s.len() - tail.len();
    let mut bits: u32 = 0;
    let mut nbits = 0;
    let mut pending = [0u8; 4];
    let mut np = 0;
    for (i, &ch) in tail.iter().enumerate() {
        let x = B64[ch as usize];
        if x > 63 {
            return Err(IntakeError::Base64(base + i));
        }
        bits = bits << 6 | x as u32;
        nbits += 6;
        if nbits >= 8 {
            nbits -= 8;
            pending[np] = (bits >> nbits) as u8;
            bits &= (1 << nbits) - 1;
            np += 1;
            if np == 4 {
                out.push(u32::from_le_bytes(pending));
                np = 0;
            }
        }
    }
    if np != 0 {
        return Err(IntakeError::Base64(s.len()));
    }
    Ok(())
}

/// Encodes tokens as base64 of little-endian `u32`s (standard alphabet, padded): what a client
/// puts in the token header.
pub fn encode_base64_u32(tokens: &[u32]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let w = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for k in 0..4 {
            if k <= c.len() {
                out.push(A[(w >> (18 - 6 * k)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// What kind of value a field holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// An array of token ids.
    Tokens,
    /// A string.
    Str,
    /// A non-negative integer (`max_tokens`, say).
    Uint,
    /// An array of token ids or, failing that, a string (a completions `prompt` holds either):
    /// [`Found::Tokens`] or [`Found::Str`].
    TokensOrText,
    /// Any value, kept as its raw byte span ([`Found::Raw`]): a chat `messages` array, passed
    /// on verbatim or read later by whoever needs it.
    Raw,
}

/// What the scanner found for one field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Found {
    /// Not in the body.
    #[default]
    Absent,
    /// Present but not of the asked kind (a text prompt, a number for a name): not usable.
    Other,
    /// Token ids in `tokens[start..end]`.
    Tokens {
        /// First token's index.
        start: usize,
        /// One past the last token's index.
        end: usize,
    },
    /// A string: the raw bytes between the quotes are `body[start..end]`; `escaped` says they
    /// contain backslash escapes (see [`unescape`]).
    Str {
        /// Offset of the first byte after the opening quote.
        start: usize,
        /// Offset of the closing quote.
        end: usize,
        /// Whether the bytes contain backslash escapes.
        escaped: bool,
    },
    /// A non-negative integer that fits in 64 bits.
    Uint(u64),
    /// A value's raw bytes `body[start..end]`, checked to be well-formed JSON.
    Raw {
        /// Offset of the value's first byte.
        start: usize,
        /// One past its last byte.
        end: usize,
    },
}

/// Scans a JSON object body once, filling `found[i]` for `fields[i]` and appending token
/// arrays to `tokens` (cleared first).
///
/// A key is compared after unescaping (`"pro\u006dpt"` is `prompt`), and a key given twice
/// takes its last value, as the JSON parsers of the engines (Python's `json`, serde_json)
/// read it: routing must see the prompt the engine will prefill. Every occurrence is still
/// checked, so a bad token array anywhere in a routed field refuses the body.
///
/// # Errors
/// [`IntakeError`] for malformed JSON, a non-object body, a bad token, or more than
/// `max_tokens` tokens in total.
pub fn scan_json<S: AsRef<str>>(
    body: &[u8],
    fields: &[(S, FieldKind)],
    tokens: &mut Vec<u32>,
    found: &mut [Found],
    max_tokens: usize,
) -> Result<(), IntakeError> {
    scan_json_with(body, fields, tokens, found, max_tokens, true)
}

/// [`scan_json`] with its token arrays read a byte at a time only (no word path): the
/// reference the word path is tested against (`tests/intake_props.rs`). Not for use.
///
/// # Errors
/// As [`scan_json`].
#[doc(hidden)]
pub fn scan_json_bytewise<S: AsRef<str>>(
    body: &[u8],
    fields: &[(S, FieldKind)],
    tokens: &mut Vec<u32>,
    found: &mut [Found],
    max_tokens: usize,
) -> Result<(), IntakeError> {
    scan_json_with(body, fields, tokens, found, max_tokens, false)
}

fn scan_json_with<S: AsRef<str>>(
    body: &[u8],
    fields: &[(S, FieldKind)],
    tokens: &mut Vec<u32>,
    found: &mut [Found],
    max_tokens: usize,
    words: bool,
) -> Result<(), IntakeError> {
    tokens.clear();
    for f in found.iter_mut() {
        *f = Found::Absent;
    }
    let mut p = Scanner {
        b: body,
        i: 0,
        words,
    };
    p.ws();
    match p.peek() {
        None => return Err(IntakeError::Empty),
        Some(b'{') => p.i += 1,
        Some(_) => {
            p.skip_value()?;
            p.ws();
            return Err(if p.i == body.len() {
                IntakeError::NotObject
            } else {
                IntakeError::Json(p.i)
            });
        }
    }
    p.ws();
    if p.peek() == Some(b'}') {
        p.i += 1;
    } else {
        loop {
            p.ws();
            let (ks, ke, key_escaped) = p.string()?;
            p.ws();
            p.expect(b':')?;
            p.ws();
            let raw_key = &body[ks..ke];
            // Escaped keys are rare: unescaped only when they have a backslash at all.
            let unescaped = if key_escaped { unescape(raw_key) } else { None };
            let key = unescaped.as_ref().map_or(raw_key, |k| k.as_bytes());
            let slot = fields
                .iter()
                .position(|(name, _)| name.as_ref().as_bytes() == key);
            match slot {
                Some(fi) if fi < found.len() => {
                    let value = match fields[fi].1 {
                        FieldKind::Tokens => p.token_array(tokens, max_tokens)?,
                        FieldKind::TokensOrText if p.peek() == Some(b'"') => {
                            let (start, end, escaped) = p.string()?;
                            Found::Str {
                                start,
                                end,
                                escaped,
                            }
                        }
                        FieldKind::TokensOrText => p.token_array(tokens, max_tokens)?,
                        FieldKind::Raw => {
                            let start = p.i;
                            p.skip_value()?;
                            Found::Raw { start, end: p.i }
                        }
                        FieldKind::Str => {
                            if p.peek() == Some(b'"') {
                                let (start, end, escaped) = p.string()?;
                                Found::Str {
                                    start,
                                    end,
                                    escaped,
                                }
                            } else {
                                p.skip_value()?;
                                Found::Other
                            }
                        }
                        FieldKind::Uint => {
                            let start = p.i;
                            p.skip_value()?;
                            std::str::from_utf8(&body[start..p.i])
                                .ok()
                                .and_then(|n| n.parse::<u64>().ok())
                                .map_or(Found::Other, Found::Uint)
                        }
                    };
                    if let Some(f) = found.get_mut(fi) {
                        *f = value;
                    }
                }
                _ => p.skip_value()?,
            }
            p.ws();
            match p.next() {
                Some(b',') => continue,
                Some(b'}') => break,
                _ => return Err(IntakeError::Json(p.i.saturating_sub(1))),
            }
        }
    }
    p.ws();
    if p.i != body.len() {
        return Err(IntakeError::Json(p.i));
    }
    Ok(())
}

/// Unescapes the raw bytes of a JSON string (as [`Found::Str`] gives them).
pub fn unescape(raw: &[u8]) -> Option<String> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let c = raw[i];
        if c != b'\\' {
            out.push(c);
            i += 1;
            continue;
        }
        let e = *raw.get(i + 1)?;
        i += 2;
        let ch = match e {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let hi = hex4(raw.get(i..i + 4)?)?;
                i += 4;
                if (0xD800..0xDC00).contains(&hi) {
                    if raw.get(i..i + 2)? != b"\\u" {
                        return None;
                    }
                    let lo = hex4(raw.get(i + 2..i + 6)?)?;
                    i += 6;
                    if !(0xDC00..0xE000).contains(&lo) {
                        return None;
                    }
                    char::from_u32(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00))?
                } else {
                    char::from_u32(hi)?
                }
            }
            _ => return None,
        };
        let mut buf = [0u8; 4];
        out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
    }
    String::from_utf8(out).ok()
}

fn hex4(b: &[u8]) -> Option<u32> {
    let mut v = 0;
    for &c in b {
        v = v << 4 | (c as char).to_digit(16)?;
    }
    Some(v)
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
    /// Token arrays take the word path ([`short_tokens`]) where it applies.
    words: bool,
}

impl Scanner<'_> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    #[inline]
    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.i) {
            if c == b' ' || c == b'\n' || c == b'\r' || c == b'\t' {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), IntakeError> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(IntakeError::Json(self.i))
        }
    }

    /// At an opening quote: returns the raw range and whether it has escapes.
    fn string(&mut self) -> Result<(usize, usize, bool), IntakeError> {
        self.expect(b'"')?;
        let start = self.i;
        let mut escaped = false;
        let b = self.b;
        let mut i = self.i;
        loop {
            // Fast path: eight bytes at a time while none is a quote, a backslash or a control.
            while let Some(chunk) = b.get(i..i + 8) {
                let mut w = [0u8; 8];
                w.copy_from_slice(chunk);
                let x = u64::from_le_bytes(w);
                if has_special(x) {
                    break;
                }
                i += 8;
            }
            let Some(&c) = b.get(i) else {
                return Err(IntakeError::Json(i));
            };
            match c {
                b'"' => {
                    self.i = i + 1;
                    return Ok((start, i, escaped));
                }
                b'\\' => {
                    escaped = true;
                    match b.get(i + 1) {
                        Some(b'u') => {
                            let ok = b
                                .get(i + 2..i + 6)
                                .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit));
                            if !ok {
                                return Err(IntakeError::Json(i));
                            }
                            i += 6;
                        }
                        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i += 2,
                        _ => return Err(IntakeError::Json(i)),
                    }
                }
                c if c < 0x20 => return Err(IntakeError::Json(i)),
                _ => i += 1,
            }
        }
    }

    fn number(&mut self) -> Result<(), IntakeError> {
        let start = self.i;
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        let int_start = self.i;
        let digits = self.digits();
        if digits == 0 {
            return Err(IntakeError::Json(start));
        }
        // JSON forbids leading zeros; the engines' parsers refuse such a body, so must we.
        if digits > 1 && self.b[int_start] == b'0' {
            return Err(IntakeError::Json(int_start));
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return Err(IntakeError::Json(self.i));
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(IntakeError::Json(self.i));
            }
        }
        Ok(())
    }

    fn digits(&mut self) -> usize {
        let s = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        self.i - s
    }

    fn literal(&mut self, word: &[u8]) -> Result<(), IntakeError> {
        if self.b.get(self.i..self.i + word.len()) == Some(word) {
            self.i += word.len();
            Ok(())
        } else {
            Err(IntakeError::Json(self.i))
        }
    }

    /// Skips one value, checking its structure, iteratively (a bit stack of up to
    /// [`MAX_DEPTH`] levels: 1 = array, 0 = object).
    fn skip_value(&mut self) -> Result<(), IntakeError> {
        let mut stack: u128 = 0;
        let mut depth: u32 = 0;
        loop {
            // A value.
            self.ws();
            match self.peek() {
                Some(b'{') | Some(b'[') => {
                    let is_array = self.peek() == Some(b'[');
                    if depth >= MAX_DEPTH {
                        return Err(IntakeError::TooDeep(self.i));
                    }
                    self.i += 1;
                    stack = stack << 1 | is_array as u128;
                    depth += 1;
                    self.ws();
                    let close = if is_array { b']' } else { b'}' };
                    if self.peek() == Some(close) {
                        self.i += 1;
                        stack >>= 1;
                        depth -= 1;
                    } else {
                        if !is_array {
                            self.string()?;
                            self.ws();
                            self.expect(b':')?;
                        }
                        continue;
                    }
                }
                Some(b'"') => {
                    self.string()?;
                }
                Some(b't') => self.literal(b"true")?,
                Some(b'f') => self.literal(b"false")?,
                Some(b'n') => self.literal(b"null")?,
                Some(_) => self.number()?,
                None => return Err(IntakeError::Json(self.i)),
            }
            // After a value: close containers or move to the next element.
            loop {
                if depth == 0 {
                    return Ok(());
                }
                self.ws();
                let is_array = stack & 1 == 1;
                match self.next() {
                    Some(b',') => {
                        if !is_array {
                            self.ws();
                            self.string()?;
                            self.ws();
                            self.expect(b':')?;
                        }
                        break;
                    }
                    Some(b']') if is_array => {
                        stack >>= 1;
                        depth -= 1;
                    }
                    Some(b'}') if !is_array => {
                        stack >>= 1;
                        depth -= 1;
                    }
                    _ => return Err(IntakeError::Json(self.i.saturating_sub(1))),
                }
            }
        }
    }

    /// A token array at the cursor: appended to `tokens`; a non-array or an array of strings
    /// or arrays (text prompts, batches) is [`Found::Other`].
    fn token_array(
        &mut self,
        tokens: &mut Vec<u32>,
        max_tokens: usize,
    ) -> Result<Found, IntakeError> {
        if self.peek() != Some(b'[') {
            self.skip_value()?;
            return Ok(Found::Other);
        }
        let open = self.i;
        self.i += 1;
        self.ws();
        let start = tokens.len();
        match self.peek() {
            Some(b']') => {
                self.i += 1;
                return Ok(Found::Tokens { start, end: start });
            }
            Some(b'"' | b'[' | b'{') => {
                self.i = open;
                self.skip_value()?;
                return Ok(Found::Other);
            }
            _ => {}
        }
        let b = self.b;
        let mut i = self.i;
        let limit = start.saturating_add(max_tokens);
        loop {
            // The common tokens (1 to 7 digits, then `,` or `]`) a word at a time; whatever
            // it leaves (longer numbers, other whitespace, errors) the byte path below takes.
            let (next, closed) = if self.words {
                short_tokens(b, i, tokens, limit)
            } else {
                (i, false)
            };
            i = next;
            if closed {
                self.i = i;
                return Ok(Found::Tokens {
                    start,
                    end: tokens.len(),
                });
            }
            // One token, after any whitespace the word path left.
            while let Some(b' ' | b'\n' | b'\r' | b'\t') = b.get(i) {
                i += 1;
            }
            let tstart = i;
            let mut x: u64 = 0;
            let mut n = 0;
            if let Some((value, digits)) = b.get(i..i + 8).and_then(short_number) {
                // Fast path: up to 7 digits read from one 8-byte word.
                x = value;
                n = digits;
                i += digits;
            } else {
                while let Some(&c) = b.get(i) {
                    let d = c.wrapping_sub(b'0');
                    if d > 9 {
                        break;
                    }
                    x = x * 10 + d as u64;
                    n += 1;
                    i += 1;
                    if n > 10 {
                        break;
                    }
                }
            }
            if n == 0 {
                return Err(match b.get(i) {
                    Some(b'-') => IntakeError::Negative(i),
                    None => IntakeError::Json(i),
                    _ => IntakeError::NotInteger(i),
                });
            }
            if x > u32::MAX as u64 || n > 10 {
                return Err(IntakeError::TooLarge(tstart));
            }
            if n > 1 && b[tstart] == b'0' {
                return Err(IntakeError::Json(tstart));
            }
            if matches!(b.get(i), Some(b'.' | b'e' | b'E')) {
                return Err(IntakeError::NotInteger(tstart));
            }
            if tokens.len() - start >= max_tokens {
                return Err(IntakeError::TooMany(max_tokens));
            }
            tokens.push(x as u32);
            // Separator: the common case ", " is handled without the general whitespace loop.
            match b.get(i) {
                Some(b',') => {
                    i += 1;
                    if b.get(i) == Some(&b' ') {
                        i += 1;
                    }
                }
                Some(b']') => {
                    self.i = i + 1;
                    return Ok(Found::Tokens {
                        start,
                        end: tokens.len(),
                    });
                }
                _ => {
                    self.i = i;
                    self.ws();
                    i = self.i;
                    match b.get(i) {
                        Some(b',') => i += 1,
                        Some(b']') => {
                            self.i = i + 1;
                            return Ok(Found::Tokens {
                                start,
                                end: tokens.len(),
                            });
                        }
                        _ => return Err(IntakeError::Json(i)),
                    }
                }
            }
            while let Some(&c) = b.get(i) {
                if c == b' ' || c == b'\n' || c == b'\r' || c == b'\t' {
                    i += 1;
                } else {
                    break;
                }
            }
        }
    }
}

/// The leading run of 1 to 7 ASCII digits of an 8-byte window, as `(value, digits)`; `None`
/// when the window starts with a non-digit or holds 8 digits (the caller's byte loop takes
/// those). SWAR: one word flags the non-digits, the first of which ends the number, and three
/// multiplies combine the digits (as in simdjson's `parse_eight_digits_unrolled`).
#[inline]
fn short_number(window: &[u8]) -> Option<(u64, usize)> {
    let mut w = [0u8; 8];
    w.copy_from_slice(window.get(..8)?);
    let x = u64::from_le_bytes(w).wrapping_sub(0x3030_3030_3030_3030);
    // A byte is a non-digit when its value minus '0' is above 9: either its high bit is set,
    // or adding 0x76 sets it. Carries only run upward from a byte that is flagged already, so
    // the lowest flag is exact.
    let flags = (x | x.wrapping_add(0x7676_7676_7676_7676)) & 0x8080_8080_8080_8080;
    let digits = (flags.trailing_zeros() / 8) as usize;
    if digits == 0 || digits >= 8 {
        return None;
    }
    // Keep the digits, moved to the top bytes: the bytes below become leading zeros.
    Some((eight_digits(x << (8 * (8 - digits))), digits))
}

/// Reads the common tokens of a token array from `b[i..]` into `tokens` (while it holds fewer
/// than `limit`): each a number of 1 to 7 digits without a leading zero, directly followed by
/// `,` and at most one space, or by the closing `]`. Stops at the first token it cannot take
/// whole, which the caller's byte path then reads (or refuses), and returns the position and
/// whether the `]` was consumed. It takes a token only when the byte path would read the same
/// value and the same separator, so both paths accept and refuse the same bodies.
///
/// 64 bytes at a time: one mask of the window's non-digits, then the tokens in it found from
/// that mask (so finding the next token does not wait for the previous token's value), each
/// token's digits combined from one 8-byte word.
#[inline]
fn short_tokens(b: &[u8], mut i: usize, tokens: &mut Vec<u32>, limit: usize) -> (usize, bool) {
    while let Some(win) = b.get(i..).and_then(|r| r.first_chunk::<72>()) {
        let nondigit = match window::take(win, tokens, limit) {
            window::Window::Taken(n) => {
                i += n;
                continue;
            }
            window::Window::Left { nondigit } => nondigit,
        };
        let digit = !nondigit;
        // The first digit of every run of digits in the window.
        let mut starts = digit & !(digit << 1);
        // Where the next token must start: right after the previous one's separator.
        let mut p = 0usize;
        while starts != 0 {
            let s = starts.trailing_zeros() as usize;
            starts &= starts - 1;
            let rest = nondigit >> s;
            if s != p || rest == 0 || tokens.len() >= limit {
                // Something else between the tokens, a run reaching the window's end, or full.
                break;
            }
            let digits = rest.trailing_zeros() as usize;
            let Some(&w) = win.get(s..).and_then(|r| r.first_chunk::<8>()) else {
                return (i + s, false);
            };
            // A run ends inside the window (`rest != 0`): `s + digits < 64`.
            let sep = win[(s + digits) & 63];
            if digits > 7 || (digits > 1 && w[0] == b'0') {
                return (i + s, false);
            }
            if sep != b',' && sep != b']' {
                return (i + s, false);
            }
            tokens.push(swar_digits(u64::from_le_bytes(w), digits) as u32);
            if sep == b']' {
                return (i + s + digits + 1, true);
            }
            p = s + digits + 1;
            if win.get(p) == Some(&b' ') {
                p += 1;
            }
        }
        if p == 0 {
            break;
        }
        i += p;
    }
    (i, false)
}

/// Whether any byte of `x` is `"`, `\` or below 0x20 (SWAR).
#[inline]
fn has_special(x: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let quote = zero(x ^ (ONES * b'"' as u64));
    let bslash = zero(x ^ (ONES * b'\\' as u64));
    let ctrl = x.wrapping_sub(ONES * 0x20) & !x & HIGH;
    (quote | bslash | ctrl) != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const FIELDS: [(&str, FieldKind); 5] = [
        ("prompt", FieldKind::Tokens),
        ("prompt_token_ids", FieldKind::Tokens),
        ("input_ids", FieldKind::Tokens),
        ("model", FieldKind::Str),
        ("cache_salt", FieldKind::Str),
    ];

    fn scan(body: &str) -> Result<(Vec<u32>, [Found; 5]), IntakeError> {
        let mut t = Vec::new();
        let mut f = [Found::Absent; 5];
        scan_json(body.as_bytes(), &FIELDS, &mut t, &mut f, 1 << 20)?;
        Ok((t, f))
    }

    #[test]
    fn header_values_decimal_and_base64() {
        let mut out = Vec::new();
        parse_token_string(b" 1, 2,3 ", &mut out, 100).unwrap();
        assert_eq!(out, [1, 2, 3]);
        parse_token_string(b"4294967295", &mut out, 100).unwrap();
        assert_eq!(out, [u32::MAX]);
        let b64 = encode_base64_u32(&[1, 2, 70000, u32::MAX, 5]);
        parse_token_string(b64.as_bytes(), &mut out, 100).unwrap();
        assert_eq!(out, [1, 2, 70000, u32::MAX, 5]);
        parse_token_string(b64.trim_end_matches('=').as_bytes(), &mut out, 100).unwrap();
        assert_eq!(out.len(), 5);
        assert_eq!(
            parse_token_string(b"1,-2", &mut out, 100),
            Err(IntakeError::Negative(2))
        );
        assert_eq!(
            parse_token_string(b"1,4294967296", &mut out, 100),
            Err(IntakeError::TooLarge(2))
        );
        assert_eq!(
            parse_token_string(b"1,2.5", &mut out, 100),
            Err(IntakeError::NotInteger(3))
        );
        assert_eq!(
            parse_token_string(b"1,,2", &mut out, 100),
            Err(IntakeError::NotInteger(2))
        );
        assert_eq!(
            parse_token_string(b"   ", &mut out, 100),
            Err(IntakeError::Empty)
        );
        assert!(matches!(
            parse_token_string(b"!!!!garbage", &mut out, 100),
            Err(IntakeError::Base64(_))
        ));
        assert!(
            matches!(
                parse_token_string(b"AAAAAAAAAA", &mut out, 100),
                Err(IntakeError::Base64(_))
            ),
            "10 chars = 7 bytes"
        );
        assert_eq!(
            parse_token_string(b"1,2,3", &mut out, 2),
            Err(IntakeError::TooMany(2))
        );
        assert!(matches!(
            parse_token_string(b"12345678901,2", &mut out, 100),
            Err(IntakeError::Base64(_))
        ));
        parse_token_string(b"1234567890 , 7", &mut out, 100).unwrap();
        assert_eq!(out, [1_234_567_890, 7]);
    }

    #[test]
    fn integer_fields_are_read_and_anything_else_is_other() {
        let fields = [("max_tokens", FieldKind::Uint), ("n", FieldKind::Uint)];
        let mut toks = Vec::new();
        let mut found = [Found::Absent; 2];
        for (body, want) in [
            (
                r#"{"max_tokens": 512, "n": 1}"#,
                [Found::Uint(512), Found::Uint(1)],
            ),
            (r#"{"max_tokens":-1,"n":1.5}"#, [Found::Other, Found::Other]),
            (
                r#"{"max_tokens":"9","n":1e3}"#,
                [Found::Other, Found::Other],
            ),
            (
                r#"{"max_tokens":99999999999999999999}"#,
                [Found::Other, Found::Absent],
            ),
            (r#"{"max_tokens":null}"#, [Found::Other, Found::Absent]),
        ] {
            scan_json(body.as_bytes(), &fields, &mut toks, &mut found, 10).unwrap();
            assert_eq!(found, want, "{body}");
        }
    }

    #[test]
    fn body_fields_are_found_in_one_pass() {
        let (t, f) = scan(r#"{"model":"m\"x","messages":[{"a":[1,2,{"b":null}]}],"prompt":[1, 2 ,3],"input_ids":[],"n":-1.5e3,"ok":true}"#).unwrap();
        assert_eq!(t, [1, 2, 3]);
        assert_eq!(f[0], Found::Tokens { start: 0, end: 3 });
        assert_eq!(f[1], Found::Absent);
        assert_eq!(f[2], Found::Tokens { start: 3, end: 3 });
        match f[3] {
            Found::Str {
                start,
                end,
                escaped: true,
            } => {
                let raw = &r#"{"model":"m\"x""#.as_bytes()[start..end];
                assert_eq!(unescape(raw).as_deref(), Some("m\"x"));
            }
            other => panic!("{other:?}"),
        }
        let (_, f) = scan(r#"{"prompt":"text","prompt_token_ids":[7]}"#).unwrap();
        assert_eq!(f[0], Found::Other);
        assert_eq!(f[1], Found::Tokens { start: 0, end: 1 });
        let (_, f) = scan(r#"{"prompt":["a","b"],"model":5}"#).unwrap();
        assert_eq!(f[0], Found::Other);
        assert_eq!(f[3], Found::Other);
    }

    /// Asserts that each body is refused with the error kind beside it (the byte offsets are
    /// the scanner's business; the kind is the contract).
    fn refused(cases: &[(&str, IntakeError)]) {
        for (body, want) in cases {
            match scan(body) {
                Err(got) => assert_eq!(
                    std::mem::discriminant(&got),
                    std::mem::discriminant(want),
                    "{body}: {got:?}, want {want:?}"
                ),
                Ok(ok) => panic!("{body}: accepted as {ok:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn bad_bodies_are_errors() {
        assert_eq!(scan("").err(), Some(IntakeError::Empty));
        assert_eq!(scan("[1,2]").err(), Some(IntakeError::NotObject));
        // A leading zero in a value skipped over (found by the serde property test).
        assert_eq!(
            scan(r#"{"x":[01],"prompt":[1]}"#).err(),
            Some(IntakeError::Json(6))
        );
        assert!(scan(r#"{"x":[0, -0, 0.5, 10],"prompt":[1]}"#).is_ok());
        let deep = format!("{{\"x\":{}{}}}", "[".repeat(200), "]".repeat(200));
        refused(&[
            (r#"{"prompt":[1,2"#, IntakeError::Json(0)),
            (r#"{"prompt":[1,2]"#, IntakeError::Json(0)),
            (r#"{"prompt":[1,2]} x"#, IntakeError::Json(0)),
            (r#"{"prompt":[1,-2]}"#, IntakeError::Negative(0)),
            (r#"{"prompt":[1,2.0]}"#, IntakeError::NotInteger(0)),
            (r#"{"prompt":[1,1e3]}"#, IntakeError::NotInteger(0)),
            (r#"{"prompt":[1,"2"]}"#, IntakeError::NotInteger(0)),
            (r#"{"prompt":[4294967296]}"#, IntakeError::TooLarge(0)),
            (
                r#"{"prompt":[99999999999999999999]}"#,
                IntakeError::TooLarge(0),
            ),
            (r#"{"x":[1 2]}"#, IntakeError::Json(0)),
            (r#"{"x":{"a" 1}}"#, IntakeError::Json(0)),
            (r#"{"x":[}"#, IntakeError::Json(0)),
            (r#"{"x":tru}"#, IntakeError::Json(0)),
            ("{\"x\":\"a\u{1}\"}", IntakeError::Json(0)),
            (&deep, IntakeError::TooDeep(0)),
        ]);
        assert!(scan(r#"{}"#).is_ok());
        assert!(scan(" {\"x\" : [ ] , \"y\":{ } } ").is_ok());
    }

    #[test]
    fn text_prompts_and_message_spans_are_found() {
        let fields = [
            ("prompt", FieldKind::TokensOrText),
            ("messages", FieldKind::Raw),
        ];
        let mut t = Vec::new();
        let mut f = [Found::Absent; 2];
        let body = r#"{"messages": [{"role":"user","content":"h\u00e9"}] ,"prompt":"a\nb"}"#;
        scan_json(body.as_bytes(), &fields, &mut t, &mut f, 10).unwrap();
        let Found::Raw { start, end } = f[1] else {
            panic!("{:?}", f[1])
        };
        assert_eq!(
            &body[start..end],
            r#"[{"role":"user","content":"h\u00e9"}]"#
        );
        let Found::Str {
            start,
            end,
            escaped: true,
        } = f[0]
        else {
            panic!("{:?}", f[0])
        };
        assert_eq!(
            unescape(&body.as_bytes()[start..end]).as_deref(),
            Some("a\nb")
        );
        // Token ids still read as tokens; anything else is `Other`, a broken span an error.
        scan_json(br#"{"prompt":[1,2]}"#, &fields, &mut t, &mut f, 10).unwrap();
        assert_eq!(f[0], Found::Tokens { start: 0, end: 2 });
        scan_json(
            br#"{"prompt":7,"messages":null}"#,
            &fields,
            &mut t,
            &mut f,
            10,
        )
        .unwrap();
        assert_eq!(f[0], Found::Other);
        assert_eq!(f[1], Found::Raw { start: 23, end: 27 });
        assert!(scan_json(br#"{"messages":[{"a":}]}"#, &fields, &mut t, &mut f, 10).is_err());
    }

    #[test]
    fn short_numbers_parse_like_the_byte_loop() {
        for text in [
            "0,", "7]", "12,", "123 ", "4096,", "65535]", "999999,", "1234567]",
        ] {
            let mut w = [b' '; 8];
            w[..text.len()].copy_from_slice(text.as_bytes());
            let digits = text.bytes().take_while(u8::is_ascii_digit).count();
            let want: u64 = text[..digits].parse().unwrap();
            assert_eq!(short_number(&w), Some((want, digits)), "{text}");
        }
        assert_eq!(short_number(b"12345678"), None, "8 digits: the byte loop");
        assert_eq!(short_number(b",1234567"), None);
        assert_eq!(short_number(b"-1234567"), None);
        assert_eq!(short_number(b"1/345678"), Some((1, 1)));
        assert_eq!(short_number(b"1:345678"), Some((1, 1)));
        refused(&[
            (r#"{"prompt":[007, 1]}"#, IntakeError::Json(0)),
            (r#"{"prompt":[12.5, 1]}"#, IntakeError::NotInteger(0)),
            (r#"{"prompt":[12e5, 1]}"#, IntakeError::NotInteger(0)),
            (
                r#"{"prompt":[4294967295, 4294967296]}"#,
                IntakeError::TooLarge(0),
            ),
        ]);
        assert_eq!(
            scan(r#"{"prompt":[4294967295, 0, 10, 12345678, 1234567]}"#)
                .unwrap()
                .0,
            [u32::MAX, 0, 10, 12_345_678, 1_234_567]
        );
    }

    #[test]
    fn swar_special_detection() {
        assert!(!has_special(u64::from_le_bytes(*b"abcdefgh")));
        assert!(has_special(u64::from_le_bytes(*b"abc\"efgh")));
        assert!(has_special(u64::from_le_bytes(*b"abcdefg\\")));
        assert!(has_special(u64::from_le_bytes(*b"\nbcdefgh")));
        assert!(!has_special(u64::from_le_bytes([
            0xe2, 0x82, 0xac, b'a', 0xff, 0x80, b'~', b' '
        ])));
    }

    proptest! {
        #[test]
        fn token_arrays_round_trip(tokens in proptest::collection::vec(any::<u32>(), 0..200), spaces in any::<bool>()) {
            let sep = if spaces { " ,\n " } else { "," };
            let list: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
            let body = format!(r#"{{"messages":[{{"role":"user","content":"hi \"there\""}}],"prompt":[{}],"model":"m"}}"#, list.join(sep));
            let (t, f) = scan(&body).unwrap();
            prop_assert_eq!(&t, &tokens);
            prop_assert_eq!(f[0], Found::Tokens { start: 0, end: tokens.len() });
            let mut out = Vec::new();
            parse_token_string(encode_base64_u32(&tokens).as_bytes(), &mut out, 1000).or_else(|e| if tokens.is_empty() { Ok(()) } else { Err(e) }).unwrap();
            prop_assert_eq!(&out, &tokens);
            if !tokens.is_empty() {
                parse_token_string(list.join(", ").as_bytes(), &mut out, 1000).unwrap();
                prop_assert_eq!(&out, &tokens);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut t = Vec::new();
            let mut f = [Found::Absent; 5];
            let _ = scan_json(&bytes, &FIELDS, &mut t, &mut f, 1000);
            let _ = parse_token_string(&bytes, &mut t, 1000);
            let _ = unescape(&bytes);
        }

        #[test]
        fn valid_json_agrees_with_serde(v in arb_json()) {
            let body = serde_json::json!({"x": v, "prompt": [1, 2]}).to_string();
            let (t, _) = scan(&body).unwrap();
            prop_assert_eq!(t, vec![1, 2]);
        }
    }

    fn arb_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| serde_json::json!(f)),
            any::<i64>().prop_map(|i| serde_json::json!(i)),
            ".*".prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                proptest::collection::btree_map(".*", inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
