//! The `text` keys of the plugin configuration: routing of requests that carry text instead
//! of token ids (see `http/text.rs`).

use std::time::Duration;

use kvroute::intake::FieldKind;
use serde::Deserialize;

/// Routing of text requests (no token ids; a `prompt` string or chat `messages`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextConfig {
    /// Ask the collector to tokenize and match the text (JSON `text.exact`). Default true.
    pub exact: bool,
    /// Approximate mode when the collector cannot answer (JSON `text.approx`). Default true.
    pub approx: bool,
    /// Characters per approximate block (JSON `text.block_chars`). Default 128.
    pub block_chars: u32,
    /// Lifetime of a recorded text prefix (JSON `text.ttl_ms`). Default 10 min.
    pub ttl: Duration,
    /// Entries of the recorded-prefix table (JSON `text.max_entries`). Default 65536.
    pub max_entries: u32,
    /// More chat messages than this: not routed, `bad_text` (JSON `text.max_messages`).
    /// Default 4096.
    pub max_messages: u32,
    /// How long a model the collector has no tokenizer for goes straight to approximate mode
    /// (JSON `text.no_tokenizer_ttl_ms`). Default 60 s.
    pub no_tokenizer_ttl: Duration,
}

impl TextConfig {
    /// Whether text requests are routed at all.
    pub fn enabled(&self) -> bool {
        self.exact || self.approx
    }
}

/// Body field of a completions prompt (token ids or text).
pub const PROMPT_FIELD: &str = "prompt";
/// Body field of chat messages.
pub const MESSAGES_FIELD: &str = "messages";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawText {
    #[serde(default = "default_true")]
    pub exact: bool,
    #[serde(default = "default_true")]
    pub approx: bool,
    #[serde(default = "default_block_chars")]
    pub block_chars: u32,
    #[serde(default = "default_text_ttl")]
    pub ttl_ms: u64,
    #[serde(default = "default_text_entries")]
    pub max_entries: u32,
    #[serde(default = "default_max_messages")]
    pub max_messages: u32,
    #[serde(default = "default_no_tokenizer_ttl")]
    pub no_tokenizer_ttl_ms: u64,
}

impl Default for RawText {
    fn default() -> Self {
        RawText {
            exact: true,
            approx: true,
            block_chars: default_block_chars(),
            ttl_ms: default_text_ttl(),
            max_entries: default_text_entries(),
            max_messages: default_max_messages(),
            no_tokenizer_ttl_ms: default_no_tokenizer_ttl(),
        }
    }
}

fn default_block_chars() -> u32 {
    128
}
fn default_text_ttl() -> u64 {
    600_000
}
fn default_text_entries() -> u32 {
    65_536
}
fn default_max_messages() -> u32 {
    4096
}
fn default_no_tokenizer_ttl() -> u64 {
    60_000
}

fn default_true() -> bool {
    true
}

impl RawText {
    /// Checks the keys and adds the body fields text routing reads to `body_fields` (the
    /// prompt holds token ids or text; messages are kept as a raw span).
    ///
    /// # Errors
    /// The offending key and why.
    pub fn validate(
        &self,
        body_fields: &mut Vec<(String, FieldKind)>,
    ) -> Result<TextConfig, (&'static str, String)> {
        let t = self;
        if t.block_chars == 0 || t.block_chars > 65_536 {
            return Err(("text.block_chars", "must be 1..=65536".into()));
        }
        if t.max_entries == 0 || t.max_entries > 1 << 22 {
            return Err(("text.max_entries", "must be 1..=4194304".into()));
        }
        if t.ttl_ms == 0 {
            return Err(("text.ttl_ms", "must be at least 1".into()));
        }
        let text = TextConfig {
            exact: t.exact,
            approx: t.approx,
            block_chars: t.block_chars,
            ttl: Duration::from_millis(t.ttl_ms),
            max_entries: t.max_entries,
            max_messages: t.max_messages,
            no_tokenizer_ttl: Duration::from_millis(t.no_tokenizer_ttl_ms),
        };
        if !text.enabled() {
            return Ok(text);
        }
        for (name, kind) in [
            (PROMPT_FIELD, FieldKind::TokensOrText),
            (MESSAGES_FIELD, FieldKind::Raw),
        ] {
            match body_fields.iter_mut().find(|(n, _)| n == name) {
                Some((_, k)) if *k == FieldKind::Tokens && kind == FieldKind::TokensOrText => {
                    *k = kind;
                }
                Some(_) => {
                    return Err((
                        "text",
                        format!(
                            "body field `{name}` is read for text and cannot be another source"
                        ),
                    ));
                }
                None => body_fields.push((name.to_owned(), kind)),
            }
        }
        Ok(text)
    }
}
