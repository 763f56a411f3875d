//! A fast path for `/query` bodies: an 8k-token prompt is ~45 KB of JSON, nearly all digits,
//! and going through serde's visitor per element costs more than hashing and matching the
//! whole prompt. This scanner reads the common shape, a flat object whose `token_ids` is an
//! array of plain non-negative integers and whose other values are strings, integers or null,
//! directly from the bytes. Anything else (escapes, nesting, floats, odd whitespace in
//! numbers, errors) returns `None` and the caller uses `serde_json`, which also words the
//! error messages. So the fast path never accepts what serde would refuse.

use kvroute::api::QueryRequest;

/// Parses a `/query` body, or `None` to fall back to `serde_json`.
pub fn parse_query(body: &[u8]) -> Option<QueryRequest> {
    let mut p = Scan { b: body, i: 0 };
    p.ws();
    p.eat(b'{')?;
    let mut tokens: Option<Vec<u32>> = None;
    let mut model: Option<String> = None;
    let (mut tenant, mut lora, mut salt) = (None, None, None);
    p.ws();
    if p.peek()? == b'}' {
        return None;
    }
    loop {
        p.ws();
        let key = p.string()?;
        p.ws();
        p.eat(b':')?;
        p.ws();
        match key {
            b"token_ids" => {
                if tokens.is_some() {
                    return None;
                }
                tokens = Some(p.u32_array()?);
            }
            b"model_name" | b"model" | b"modelname" => {
                if model.is_some() {
                    return None;
                }
                model = Some(p.owned_string()?);
            }
            b"tenant_id" => tenant = p.opt_string_or_int()?,
            b"lora_name" => lora = p.opt_string()?,
            b"cache_salt" | b"additionalsalt" | b"additional_salt" => salt = p.opt_string()?,
            _ => p.skip_scalar()?,
        }
        p.ws();
        match p.next()? {
            b',' => continue,
            b'}' => break,
            _ => return None,
        }
    }
    p.ws();
    if p.i != body.len() {
        return None;
    }
    Some(QueryRequest {
        token_ids: tokens?,
        model_name: model?,
        tenant_id: tenant,
        lora_name: lora,
        cache_salt: salt,
    })
}

/// The value of 8 decimal digits, one per byte, the first in the lowest byte (digit values
/// 0..=9, not ASCII). Leading zero bytes are leading zeros.
#[inline]
fn eight_digits(v: u64) -> u64 {
    let v = (v & 0x0f0f_0f0f_0f0f_0f0f).wrapping_mul((10 << 8) + 1) >> 8;
    let v = (v & 0x00ff_00ff_00ff_00ff).wrapping_mul((100 << 16) + 1) >> 16;
    (v & 0x0000_ffff_0000_ffff).wrapping_mul((10000 << 32) + 1) >> 32
}

struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.i += 1;
        }
    }

    /// A string without escapes, as raw bytes.
    fn string(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.i;
        let rest = &self.b[start..];
        let end = rest
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || c < 0x20)?;
        if rest[end] != b'"' {
            return None;
        }
        self.i = start + end + 1;
        Some(&rest[..end])
    }

    fn owned_string(&mut self) -> Option<String> {
        std::str::from_utf8(self.string()?).ok().map(str::to_owned)
    }

    fn null(&mut self) -> Option<bool> {
        if self.b[self.i..].starts_with(b"null") {
            self.i += 4;
            return Some(true);
        }
        Some(false)
    }

    fn opt_string(&mut self) -> Option<Option<String>> {
        if self.null()? {
            return Some(None);
        }
        self.owned_string().map(Some)
    }

    fn opt_string_or_int(&mut self) -> Option<Option<String>> {
        if self.null()? {
            return Some(None);
        }
        if self.peek()? == b'"' {
            return self.owned_string().map(Some);
        }
        let start = self.i;
        self.uint()?;
        Some(Some(
            std::str::from_utf8(&self.b[start..self.i]).ok()?.to_owned(),
        ))
    }

    /// A non-negative integer without sign, fraction or exponent, at most u64.
    fn uint(&mut self) -> Option<u64> {
        let start = self.i;
        let mut v: u64 = 0;
        while let Some(c @ b'0'..=b'9') = self.peek() {
            v = v.checked_mul(10)?.checked_add((c - b'0') as u64)?;
            self.i += 1;
        }
        let n = self.i - start;
        // JSON forbids leading zeros; floats and exponents go to serde.
        if n == 0
            || (n > 1 && self.b[start] == b'0')
            || matches!(self.peek(), Some(b'.' | b'e' | b'E'))
        {
            return None;
        }
        Some(v)
    }

    /// `[n, n, ...]` of u32s. The hot loop of the fast path: one pass over the digits, no
    /// checked arithmetic (at most 10 digits, range-checked once).
    fn u32_array(&mut self) -> Option<Vec<u32>> {
        self.eat(b'[')?;
        let b = self.b;
        let mut i = self.i;
        let is_ws = |c: u8| matches!(c, b' ' | b'\n' | b'\r' | b'\t');
        // Every element takes at least 2 bytes ("1,"): a bound for the reservation.
        let mut out = Vec::with_capacity((b.len() - i) / 2 + 1);
        while i < b.len() && is_ws(b[i]) {
            i += 1;
        }
        if b.get(i) == Some(&b']') {
            self.i = i + 1;
            return Some(out);
        }
        loop {
            while i < b.len() && is_ws(b[i]) {
                i += 1;
            }
            let start = i;
            let mut v: u64 = 0;
            // Up to 7 digits at once (SWAR); 8 or more, or the end of the body, go digit by digit.
            if let Some(chunk) = b.get(i..i + 8) {
                let x =
                    u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8])) ^ 0x3030_3030_3030_3030;
                // High bit of each byte set where the byte is not an ASCII digit (no carries
                // cross bytes: the high bits are masked off before the add).
                let nondigit = (((x & 0x7f7f_7f7f_7f7f_7f7f).wrapping_add(0x7676_7676_7676_7676))
                    | x)
                    & 0x8080_8080_8080_8080;
                let n = (nondigit.trailing_zeros() / 8) as usize;
                if (1..8).contains(&n) {
                    v = eight_digits(x << (8 * (8 - n)));
                    i += n;
                }
            }
            while i < b.len() {
                let d = b[i].wrapping_sub(b'0');
                if d > 9 {
                    break;
                }
                v = v * 10 + d as u64;
                i += 1;
                if i - start > 10 {
                    return None;
                }
            }
            let n = i - start;
            // JSON forbids leading zeros; signs, fractions and exponents go to serde.
            if n == 0 || (n > 1 && b[start] == b'0') || v > u32::MAX as u64 {
                return None;
            }
            out.push(v as u32);
            let mut c = *b.get(i)?;
            if is_ws(c) {
                while i < b.len() && is_ws(b[i]) {
                    i += 1;
                }
                c = *b.get(i)?;
            }
            i += 1;
            match c {
                b',' => {}
                b']' => {
                    self.i = i;
                    return Some(out);
                }
                _ => return None,
            }
        }
    }

    /// Skips a string, integer, true, false or null.
    fn skip_scalar(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(|_| ()),
            b'0'..=b'9' => self.uint().map(|_| ()),
            _ => {
                for word in [&b"true"[..], b"false", b"null"] {
                    if self.b[self.i..].starts_with(word) {
                        self.i += word.len();
                        return Some(());
                    }
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn common_bodies_take_the_fast_path() {
        let q = parse_query(br#"{"token_ids": [1, 22, 333], "model_name": "m", "tenant_id": 7, "cache_salt": null}"#).unwrap();
        assert_eq!(q.token_ids, vec![1, 22, 333]);
        assert_eq!(q.model_name, "m");
        assert_eq!(q.tenant_id.as_deref(), Some("7"));
        assert_eq!(q.cache_salt, None);
        assert!(parse_query(br#"{"model":"m","token_ids":[],"extra":true}"#).is_some());
    }

    #[test]
    fn anything_unusual_falls_back() {
        for body in [
            &br#"{"token_ids": [1, -2], "model_name": "m"}"#[..],
            br#"{"token_ids": [1.5], "model_name": "m"}"#,
            br#"{"token_ids": [01], "model_name": "m"}"#,
            br#"{"token_ids": [4294967296], "model_name": "m"}"#,
            br#"{"token_ids": [1], "model_name": "m\"x"}"#,
            br#"{"token_ids": [1], "model_name": "m", "x": {}}"#,
            br#"{"token_ids": [1]}"#,
            br#"{"token_ids": [1], "model_name": "m"} x"#,
            br#"{"token_ids": [1], "token_ids": [2], "model_name": "m"}"#,
            br#"{"token_ids": [1,], "model_name": "m"}"#,
            b"",
        ] {
            assert!(
                parse_query(body).is_none(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn swar_digits() {
        for (text, want) in [
            ("1", 1u64),
            ("12", 12),
            ("1234567", 1234567),
            ("9999999", 9999999),
            ("5000", 5000),
        ] {
            let mut bytes = [b','; 8];
            bytes[..text.len()].copy_from_slice(text.as_bytes());
            let x = u64::from_le_bytes(bytes) ^ 0x3030_3030_3030_3030;
            let n = text.len();
            assert_eq!(eight_digits(x << (8 * (8 - n))), want, "{text}");
        }
    }

    proptest! {
        /// Small and large numbers, any spacing, ending anywhere: the same as serde.
        #[test]
        fn token_arrays_agree_with_serde(tokens in proptest::collection::vec(prop_oneof![0u32..10, 0u32..100_000, any::<u32>()], 0..40),
                                         seps in proptest::collection::vec(prop_oneof![Just(","), Just(", "), Just(" ,"), Just(",\n ")], 40)) {
            let mut body = String::from("{\"model_name\":\"m\",\"token_ids\":[");
            for (i, t) in tokens.iter().enumerate() {
                if i > 0 {
                    body.push_str(seps[i]);
                }
                body.push_str(&t.to_string());
            }
            body.push_str("]}");
            let slow: QueryRequest = serde_json::from_str(&body).unwrap();
            prop_assert_eq!(parse_query(body.as_bytes()), Some(slow));
        }

        /// Whatever the fast path accepts, serde reads the same way.
        #[test]
        fn agrees_with_serde(tokens in proptest::collection::vec(any::<u32>(), 0..50),
                             model in "[a-z0-9/._-]{1,12}",
                             salt in proptest::option::of("[a-z]{0,6}"),
                             spaces in 0usize..3) {
            let ws = " ".repeat(spaces);
            let list: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
            let salt_json = salt.as_ref().map_or("null".to_owned(), |s| format!("\"{s}\""));
            let body = format!("{{{ws}\"model_name\":{ws}\"{model}\",\"token_ids\":[{}]{ws},\"cache_salt\":{salt_json}}}", list.join(&format!(",{ws}")));
            let fast = parse_query(body.as_bytes());
            let slow: QueryRequest = serde_json::from_str(&body).unwrap();
            prop_assert_eq!(fast, Some(slow));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_query(&bytes);
        }
    }
}
