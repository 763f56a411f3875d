//! A fast path for `/query` bodies: an 8k-token prompt is ~45 KB of JSON, nearly all digits,
//! and going through serde's visitor per element costs more than hashing and matching the
//! whole prompt. The body goes through the core's one-pass scanner, the one the filter's body
//! intake uses ([`kvroute::intake::scan_json`]). The common shape (a `token_ids` array of
//! integers, string fields) takes this path; anything else (numeric or null fields, two
//! aliases of one field, errors) returns `None` and the caller uses `serde_json`, which also
//! words the error messages. A body naming `prompt` or `messages` is a text query (or an
//! ambiguous one): `None`, so the caller's text parse decides.

use kvroute::api::QueryRequest;
use kvroute::intake::{scan_json, unescape, FieldKind, Found};

const FIELDS: [(&str, FieldKind); 11] = [
    ("token_ids", FieldKind::Tokens),
    ("model_name", FieldKind::Str),
    ("model", FieldKind::Str),
    ("modelname", FieldKind::Str),
    ("tenant_id", FieldKind::Str),
    ("lora_name", FieldKind::Str),
    ("cache_salt", FieldKind::Str),
    ("additionalsalt", FieldKind::Str),
    ("additional_salt", FieldKind::Str),
    // Only their presence matters (any value kind is seen as `Str` or `Other`).
    ("prompt", FieldKind::Str),
    ("messages", FieldKind::Str),
];

/// Parses a `/query` body, or `None` to fall back to `serde_json`.
pub fn parse_query(body: &[u8]) -> Option<QueryRequest> {
    let mut token_ids = Vec::new();
    let mut found = [Found::Absent; FIELDS.len()];
    scan_json(body, &FIELDS, &mut token_ids, &mut found, usize::MAX).ok()?;
    let Found::Tokens { .. } = found[0] else {
        return None;
    };
    if found[9] != Found::Absent || found[10] != Found::Absent {
        return None;
    }
    // `Some(None)`: absent; `None`: present but not a plain string (serde decides).
    let string = |f: Found| -> Option<Option<String>> {
        match f {
            Found::Absent => Some(None),
            Found::Str {
                start,
                end,
                escaped,
            } => {
                let raw = &body[start..end];
                let s = if escaped {
                    unescape(raw)?
                } else {
                    std::str::from_utf8(raw).ok()?.to_owned()
                };
                Some(Some(s))
            }
            Found::Other | Found::Tokens { .. } | Found::Uint(_) | Found::Raw { .. } => None,
        }
    };
    // Aliases of one field: exactly one may be present, as serde requires.
    let one_of = |fields: &[Found]| -> Option<Option<String>> {
        let mut present = fields.iter().filter(|f| **f != Found::Absent);
        match (present.next(), present.next()) {
            (None, _) => Some(None),
            (Some(&f), None) => string(f),
            (Some(_), Some(_)) => None,
        }
    };
    Some(QueryRequest {
        token_ids,
        model_name: one_of(&found[1..4])??,
        tenant_id: string(found[4])?,
        lora_name: string(found[5])?,
        cache_salt: one_of(&found[6..9])?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn common_bodies_take_the_fast_path() {
        let q = parse_query(br#"{"token_ids": [1, 22, 333], "model_name": "m\"x", "tenant_id": "t", "x": {"y": [1]}}"#).unwrap();
        assert_eq!(q.token_ids, vec![1, 22, 333]);
        assert_eq!(q.model_name, "m\"x");
        assert_eq!(q.tenant_id.as_deref(), Some("t"));
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
            br#"{"token_ids": [1], "model_name": "m", "tenant_id": 7}"#,
            br#"{"token_ids": [1], "model_name": "m", "cache_salt": null}"#,
            br#"{"token_ids": [1]}"#,
            br#"{"token_ids": [1], "model_name": "m"} x"#,
            br#"{"token_ids": [1], "model_name": "m", "model": "n"}"#,
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
            let salt_json = salt.as_ref().map_or(String::new(), |s| format!(",\"cache_salt\":\"{s}\""));
            let body = format!("{{{ws}\"model_name\":{ws}\"{model}\",\"token_ids\":[{}]{ws}{salt_json}}}", list.join(&format!(",{ws}")));
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
