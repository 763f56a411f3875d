//! The in-place body scanner (`kvroute::intake::scan_json`) against serde_json's full parse,
//! on generated, cut and mutated bodies: the scanner must find the token ids and strings the
//! full parse finds, or refuse the body, never route on something else.
//!
//! Bodies are written by a JSON writer of our own that picks, per byte it may vary, among the
//! forms JSON allows: the four whitespace characters anywhere between tokens, every escape of
//! every string character (`\"`, `\/`, `\n`, `\u00e9`, upper- and lower-case hex, surrogate
//! pairs), escaped keys, keys given twice, and the number forms a token array must refuse
//! (`-0`, `1.0`, `1e3`, `1E+2`, `4294967296`, ...).

use kvroute::intake::{scan_json, scan_json_bytewise, unescape, FieldKind, Found, IntakeError};
use proptest::prelude::*;
use serde_json::Value;

const FIELDS: [(&str, FieldKind); 3] = [
    ("prompt", FieldKind::Tokens),
    ("model", FieldKind::Str),
    ("max_tokens", FieldKind::Uint),
];

/// What the scanner read: the prompt's tokens (`None`: absent or not tokens) and the model.
#[derive(Debug, PartialEq, Eq)]
struct Read {
    prompt: Option<Vec<u32>>,
    model: Option<String>,
}

fn scan(body: &[u8]) -> Result<Read, IntakeError> {
    let mut tokens = Vec::new();
    let mut found = [Found::Absent; 3];
    scan_json(body, &FIELDS, &mut tokens, &mut found, 1 << 20)?;
    let prompt = match found[0] {
        Found::Tokens { start, end } => Some(tokens[start..end].to_vec()),
        _ => None,
    };
    let model = match found[1] {
        // A lone surrogate escape unescapes to nothing: the filter then has no model.
        Found::Str { start, end, .. } => unescape(&body[start..end]),
        _ => None,
    };
    Ok(Read { prompt, model })
}

/// The same fields from serde_json's document (keys unescaped, the last of duplicates).
/// `None` for the prompt when it is not an array of integers in `0..=u32::MAX`.
fn reference(v: &Value) -> Read {
    let prompt = v.get("prompt").and_then(Value::as_array).and_then(|a| {
        a.iter()
            .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<Vec<u32>>>()
    });
    let model = v.get("model").and_then(Value::as_str).map(str::to_owned);
    Read { prompt, model }
}

/// A deterministic byte source for the writer's choices.
struct Choices(u64);

impl Choices {
    fn next(&mut self, n: u64) -> u64 {
        // SplitMix64: every proptest seed gives another stream.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n.max(1)
    }

    fn ws(&mut self, out: &mut String) {
        for _ in 0..self.next(3) {
            out.push([' ', '\t', '\n', '\r'][self.next(4) as usize]);
        }
    }
}

/// A string literal with each character in one of the forms JSON allows for it.
fn write_str(s: &str, c: &mut Choices, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        let u = |out: &mut String, c: &mut Choices, x: u32| {
            if c.next(2) == 0 {
                out.push_str(&format!("\\u{x:04x}"));
            } else {
                out.push_str(&format!("\\u{x:04X}"));
            }
        };
        match ch {
            '"' | '\\' if c.next(2) == 0 => u(out, c, ch as u32),
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '/' if c.next(2) == 0 => out.push_str("\\/"),
            '\u{8}' if c.next(2) == 0 => out.push_str("\\b"),
            '\u{c}' if c.next(2) == 0 => out.push_str("\\f"),
            '\n' if c.next(2) == 0 => out.push_str("\\n"),
            '\r' if c.next(2) == 0 => out.push_str("\\r"),
            '\t' if c.next(2) == 0 => out.push_str("\\t"),
            ch if (ch as u32) < 0x20 => u(out, c, ch as u32),
            ch if c.next(4) == 0 => {
                let mut buf = [0u16; 2];
                for unit in ch.encode_utf16(&mut buf) {
                    u(out, c, *unit as u32);
                }
            }
            ch => out.push(ch),
        }
    }
    out.push('"');
}

fn write_value(v: &Value, c: &mut Choices, out: &mut String) {
    match v {
        Value::Null | Value::Bool(_) | Value::Number(_) => out.push_str(&v.to_string()),
        Value::String(s) => write_str(s, c, out),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    c.ws(out);
                    out.push(',');
                }
                c.ws(out);
                write_value(x, c, out);
                c.ws(out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                c.ws(out);
                write_str(k, c, out);
                c.ws(out);
                out.push(':');
                c.ws(out);
                write_value(x, c, out);
                c.ws(out);
            }
            out.push('}');
        }
    }
}

/// A token array element as written.
#[derive(Clone, Debug)]
enum Elem {
    /// A plain integer: the only form a token takes.
    Token(u32),
    /// Valid JSON that is no token: the body must be refused.
    Refused(&'static str),
}

const REFUSED: [&str; 11] = [
    "-0",
    "-1",
    "1.0",
    "0.5",
    "1e3",
    "1E+2",
    "2e-1",
    "4294967296",
    "99999999999999999999",
    "null",
    "true",
];

fn arb_elem() -> impl Strategy<Value = Elem> {
    prop_oneof![
        8 => any::<u32>().prop_map(Elem::Token),
        2 => (0u32..1000).prop_map(Elem::Token),
        1 => Just(Elem::Token(u32::MAX)),
        1 => (0..REFUSED.len()).prop_map(|i| Elem::Refused(REFUSED[i])),
    ]
}

/// One `"prompt"` entry: a token array, or a value that is no token array.
#[derive(Clone, Debug)]
enum PromptValue {
    Array(Vec<Elem>),
    Text(String),
    Strings(Vec<String>),
}

fn arb_prompt() -> impl Strategy<Value = PromptValue> {
    prop_oneof![
        6 => proptest::collection::vec(arb_elem(), 0..40).prop_map(PromptValue::Array),
        1 => ".{0,20}".prop_map(PromptValue::Text),
        1 => proptest::collection::vec(".{0,5}", 1..4).prop_map(PromptValue::Strings),
    ]
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|i| serde_json::json!(i)),
        (-1e6f64..1e6).prop_map(|f| serde_json::json!(f)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::btree_map(".{0,6}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A body: other keys, one or two `"prompt"`s, maybe a model, in a shuffled order, written
/// with the writer's random forms. Returns the bytes and what the scanner must read.
fn build(
    prompts: &[PromptValue],
    model: &Option<String>,
    others: &[(String, Value)],
    seed: u64,
) -> (String, Result<Read, ()>) {
    let mut c = Choices(seed);
    let mut entries: Vec<(String, String)> = Vec::new();
    for (k, v) in others {
        // A decoy key is never taken for a field.
        let k = if k == "prompt" || k == "model" {
            format!("{k}_")
        } else {
            k.clone()
        };
        let mut s = String::new();
        write_value(v, &mut c, &mut s);
        entries.push((k, s));
    }
    // The prompts keep their order (the last one counts); others go anywhere around them.
    let mut refused = false;
    let mut last = None;
    for p in prompts {
        let mut s = String::new();
        match p {
            PromptValue::Array(elems) => {
                s.push('[');
                for (i, e) in elems.iter().enumerate() {
                    if i > 0 {
                        c.ws(&mut s);
                        s.push(',');
                    }
                    c.ws(&mut s);
                    match e {
                        Elem::Token(t) => s.push_str(&t.to_string()),
                        Elem::Refused(r) => {
                            s.push_str(r);
                            refused = true;
                        }
                    }
                    c.ws(&mut s);
                }
                s.push(']');
                last = Some(
                    elems
                        .iter()
                        .filter_map(|e| match e {
                            Elem::Token(t) => Some(*t),
                            Elem::Refused(_) => None,
                        })
                        .collect(),
                );
            }
            PromptValue::Text(t) => {
                write_str(t, &mut c, &mut s);
                last = None;
            }
            PromptValue::Strings(v) => {
                write_value(&serde_json::json!(v), &mut c, &mut s);
                last = None;
            }
        }
        let at = c.next(entries.len() as u64 + 1) as usize;
        let at = at.max(
            entries
                .iter()
                .rposition(|(k, _)| k == "prompt")
                .map_or(0, |i| i + 1),
        );
        entries.insert(at.min(entries.len()), ("prompt".into(), s));
    }
    if let Some(m) = model {
        let mut s = String::new();
        write_str(m, &mut c, &mut s);
        let at = c.next(entries.len() as u64 + 1) as usize;
        entries.insert(at, ("model".into(), s));
    }
    let mut body = String::new();
    c.ws(&mut body);
    body.push('{');
    for (i, (k, v)) in entries.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        c.ws(&mut body);
        write_str(k, &mut c, &mut body);
        c.ws(&mut body);
        body.push(':');
        c.ws(&mut body);
        body.push_str(v);
        c.ws(&mut body);
    }
    body.push('}');
    c.ws(&mut body);
    let want = if refused {
        Err(())
    } else {
        Ok(Read {
            prompt: last,
            model: model.clone(),
        })
    };
    (body, want)
}

fn arb_body() -> impl Strategy<Value = (String, Result<Read, ()>)> {
    (
        proptest::collection::vec(arb_prompt(), 0..3),
        proptest::option::of(".{0,16}"),
        proptest::collection::vec((".{0,8}", arb_json()), 0..4),
        any::<u64>(),
    )
        .prop_map(|(p, m, o, seed)| build(&p, &m, &o, seed))
}

/// Whether serde_json's refusal is one the scanner need not share: invalid UTF-8 and lone
/// surrogate escapes (the scanner checks a string's form; a field it returns is decoded
/// when used, and one that does not decode counts as absent) and floats beyond f64
/// (skipped values are checked for form, not magnitude).
fn refusal_not_shared(body: &[u8], e: &serde_json::Error) -> bool {
    let e = e.to_string();
    std::str::from_utf8(body).is_err()
        || e.contains("number out of range")
        || e.contains("surrogate")
        || e.contains("hex escape")
        || e.contains("unicode code point")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn generated_bodies_read_as_serde_reads_them((body, want) in arb_body()) {
        let doc: Value = serde_json::from_str(&body).expect("the writer writes JSON");
        let got = scan(body.as_bytes());
        match want {
            Ok(want) => {
                let got = got.map_err(|e| format!("{e} in {body}"));
                prop_assert_eq!(got.as_ref(), Ok(&want));
                prop_assert_eq!(&reference(&doc), &want, "the model agrees with serde");
            }
            Err(()) => prop_assert!(
                matches!(got, Err(IntakeError::NotInteger(_) | IntakeError::Negative(_) | IntakeError::TooLarge(_))),
                "{got:?}: {body}"
            ),
        }
    }

    #[test]
    fn mutated_bodies_never_read_what_serde_does_not((body, _) in arb_body(), at in any::<usize>(), byte in prop_oneof![Just(b'"'), Just(b'\\'), Just(b','), Just(b':'), Just(b'['), Just(b']'), Just(b'{'), Just(b'}'), Just(b'-'), Just(b'.'), Just(b'e'), Just(b'0'), Just(b'9'), Just(b' '), Just(0u8), Just(0x1f), Just(0xc3), Just(0xff), Just(b'u'), any::<u8>()]) {
        let mut body = body.into_bytes();
        let i = at % body.len();
        body[i] = byte;
        let full = serde_json::from_slice::<Value>(&body);
        let got = scan(&body);
        match (&full, &got) {
            (Err(e), Ok(read)) => prop_assert!(
                refusal_not_shared(&body, e),
                "serde refuses ({e}) what the scanner read as {read:?}: {}", String::from_utf8_lossy(&body)
            ),
            (Ok(doc), Ok(read)) => {
                let r = reference(doc);
                if read.prompt.is_some() {
                    prop_assert_eq!(&read.prompt, &r.prompt);
                }
                prop_assert_eq!(&read.model, &r.model);
            }
            (Ok(doc), Err(e)) => prop_assert!(
                !doc.is_object() || matches!(e, IntakeError::NotInteger(_) | IntakeError::Negative(_) | IntakeError::TooLarge(_)),
                "{e} on a body serde reads: {}", String::from_utf8_lossy(&body)
            ),
            (Err(_), Err(_)) => {}
        }
    }
}

proptest! {
    // Every cut of every body: fewer, smaller cases (each is a scan per byte).
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn bodies_cut_at_every_byte_are_refused((body, want) in arb_body()) {
        let b = body.as_bytes();
        for k in 0..b.len() {
            let got = scan(&b[..k]);
            if b[k..].iter().all(|c| c.is_ascii_whitespace()) {
                // Only trailing whitespace was cut: the same body.
                prop_assert_eq!(got.is_ok(), want.is_ok(), "cut at {}", k);
            } else {
                prop_assert!(got.is_err(), "cut at {k} read {got:?}: {}", &body[..k]);
            }
        }
    }
}

#[test]
fn escaped_and_repeated_keys_read_as_json_parsers_read_them() {
    let read = scan(br#"{"pro\u006dpt":[1,2],"\u006dodel":"m\/x"}"#).unwrap();
    assert_eq!(read.prompt.as_deref(), Some(&[1, 2][..]));
    assert_eq!(read.model.as_deref(), Some("m/x"));
    // The last of two prompts, as Python's json and serde_json keep it.
    let read = scan(br#"{"prompt":[1,2],"model":"a","prompt":[3],"model":"b"}"#).unwrap();
    assert_eq!(read.prompt.as_deref(), Some(&[3][..]));
    assert_eq!(read.model.as_deref(), Some("b"));
    let read = scan(br#"{"prompt":[1,2],"prompt":"text"}"#).unwrap();
    assert_eq!(read.prompt, None);
    // A bad array anywhere in a routed field refuses the body, even if a later one is good.
    assert!(scan(br#"{"prompt":[1.5],"prompt":[3]}"#).is_err());
}

/// Scans with the word path and with the byte path alone: both must give the same result,
/// tokens and fields, the same error at the same byte.
fn both_paths(body: &[u8], max_tokens: usize) -> Result<(Vec<u32>, [Found; 3]), IntakeError> {
    let (mut t1, mut t2) = (Vec::new(), Vec::new());
    let (mut f1, mut f2) = ([Found::Absent; 3], [Found::Absent; 3]);
    let r1 = scan_json(body, &FIELDS, &mut t1, &mut f1, max_tokens);
    let r2 = scan_json_bytewise(body, &FIELDS, &mut t2, &mut f2, max_tokens);
    assert_eq!(r1, r2, "{}", String::from_utf8_lossy(body));
    if r1.is_ok() {
        assert_eq!((&t1, &f1), (&t2, &f2), "{}", String::from_utf8_lossy(body));
    }
    r1.map(|()| (t1, f1))
}

/// A long token array in the forms clients write (`,` or `, ` mostly, sometimes other
/// whitespace), numbers of every length, with some odd elements (leading zeros, signs,
/// fractions, 8 to 11 digits) where `odd` says. `uniform` writes every separator as the
/// first, so whole 64-byte windows of clean tokens (the scanner's window path) are common.
fn token_body(elems: &[(u32, u8, u8)], odd: u8, uniform: bool) -> String {
    let mut out = String::from(r#"{"model":"m","prompt":["#);
    let first_sep = elems.first().map_or(0, |e| e.2);
    for (k, &(v, digits, sep)) in elems.iter().enumerate() {
        let sep = if uniform { first_sep } else { sep };
        // Numbers of every length: the value cut to `digits` digits (1..=10).
        let n = v as u64 % 10u64.pow(u32::from(digits % 10 + 1));
        let num = match (odd != 0 && k % 97 == odd as usize % 97, odd % 6) {
            (true, 0) => format!("0{n}"),
            (true, 1) => format!("-{n}"),
            (true, 2) => format!("{n}.0"),
            (true, 3) => format!("{n}e1"),
            (true, 4) => format!("{}", n + 4_294_967_296),
            (true, _) => format!("{n} {n}"),
            _ => n.to_string(),
        };
        out.push_str(&num);
        if k + 1 < elems.len() {
            out.push_str(match sep % 16 {
                0 => ",\n",
                1 => " , ",
                2 => ",\t ",
                3..=8 => ",",
                _ => ", ",
            });
        }
    }
    out.push_str(r#"],"max_tokens":1}"#);
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The word path ([`scan_json`]) against the byte path alone ([`scan_json_bytewise`]) on
    /// long token arrays: the same tokens, or the same error at the same byte; also cut at
    /// random bytes, with a byte changed, and under a token limit.
    #[test]
    fn word_and_byte_paths_agree(
        elems in proptest::collection::vec((any::<u32>(), 0u8..12, any::<u8>()), 0..400),
        odd in any::<u8>(),
        cut in any::<usize>(),
        at in any::<usize>(),
        byte in prop_oneof![Just(b','), Just(b' '), Just(b']'), Just(b'0'), Just(b'7'), Just(b'\n'), Just(b'.'), Just(b'-'), any::<u8>()],
        limit in 1usize..500,
        uniform in any::<bool>(),
    ) {
        let body = token_body(&elems, odd, uniform);
        let b = body.as_bytes();
        let got = both_paths(b, 1 << 20);
        if odd == 0 {
            let (t, f) = got.map_err(|e| TestCaseError::fail(format!("{e} in {body}")))?;
            let doc: Value = serde_json::from_str(&body).expect("JSON");
            prop_assert_eq!(Some(t.clone()), reference(&doc).prompt);
            prop_assert_eq!(f[0], Found::Tokens { start: 0, end: t.len() });
        }
        both_paths(&b[..cut % (b.len() + 1)], 1 << 20).ok();
        let mut m = b.to_vec();
        m[at % b.len()] = byte;
        both_paths(&m, 1 << 20).ok();
        both_paths(b, limit).ok();
    }
}

#[test]
fn windows_without_a_token_start_are_left_to_the_byte_path() {
    // The word path meets 64 bytes without a digit where a token should start.
    for odd in ["\"", "-", " ", "[", "x"] {
        let body = format!(r#"{{"prompt":[1, 2, {}], "model": "m"}}"#, odd.repeat(80));
        assert!(both_paths(body.as_bytes(), 1 << 20).is_err(), "{body}");
    }
}
