//! Text requests: each model's tokenizer (`--tokenizer MODEL=DIR`), loaded once and shared,
//! and the turn of a prompt or chat messages into token ids for `/tokenize` and `/query`.
//!
//! Tokenizing runs on tokio's blocking pool: an 8k-token prompt is a few hundred µs of CPU
//! that must not stall the runtime's threads serving token-id queries. Size limits are checked
//! before anything is tokenized (`kvroute_text::Limits`); the tokenizer and template engine
//! never panic into the server (`kvroute_text` guards them).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use kvroute_text::{parse_messages, Limits, TextError, Tokenizer};
use serde_json::Value;

use crate::config::TokenizerSpec;
use crate::metrics::{Metrics, ReasonLabels, TextLabels};

/// What a text request carries.
#[derive(Debug, Clone)]
pub enum TextInput {
    /// A completions prompt: special tokens added by the tokenizer's rule.
    Prompt(String),
    /// OpenAI chat messages (the request's array, verbatim), rendered by the chat template.
    Messages {
        messages: Value,
        add_generation_prompt: bool,
    },
}

impl TextInput {
    /// Whether its text (every string in the messages) is at most `limit` bytes.
    fn fits(&self, limit: usize) -> bool {
        fn strings(v: &Value, budget: &mut usize) -> bool {
            match v {
                Value::String(s) => match budget.checked_sub(s.len()) {
                    Some(rest) => {
                        *budget = rest;
                        true
                    }
                    None => false,
                },
                Value::Array(items) => items.iter().all(|i| strings(i, budget)),
                Value::Object(fields) => fields.values().all(|f| strings(f, budget)),
                _ => true,
            }
        }
        match self {
            TextInput::Prompt(p) => p.len() <= limit,
            TextInput::Messages { messages, .. } => strings(messages, &mut limit.clone()),
        }
    }

    fn label(&self) -> &'static str {
        match self {
            TextInput::Prompt(_) => "prompt",
            TextInput::Messages { .. } => "messages",
        }
    }
}

/// Why a text request got no token ids.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// No `--tokenizer` for the model (404).
    #[error("no tokenizer for model {0:?}")]
    NoTokenizer(String),
    /// The text is too large (413) or cannot be rendered or encoded (422).
    #[error(transparent)]
    Text(#[from] TextError),
    /// The model's tokenizer failed to load (503; logged once, at the load).
    #[error("the tokenizer of model {model:?} is unavailable: {message}")]
    Unavailable { model: String, message: String },
    /// The blocking task died (500).
    #[error("tokenizing failed: {0}")]
    Internal(String),
}

impl TokenizeError {
    /// The metrics label of the error.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenizeError::NoTokenizer(_) => "no_tokenizer",
            TokenizeError::Text(e) => e.kind(),
            TokenizeError::Unavailable { .. } => "unavailable",
            TokenizeError::Internal(_) => "internal",
        }
    }
}

/// One model's tokenizer, loaded at most once (at start by [`Tokenizers::load_all`], or by the
/// first request when the state was built without it).
#[derive(Debug)]
struct Slot {
    spec: TokenizerSpec,
    loaded: OnceLock<Result<Arc<Tokenizer>, String>>,
}

/// The tokenizers of every `--tokenizer` model. Their number is bounded by the configuration
/// (`--max-tokenizers`): requests can never make the collector load another.
#[derive(Debug, Default)]
pub struct Tokenizers {
    slots: HashMap<String, Arc<Slot>>,
    limits: Limits,
}

impl Tokenizers {
    /// Slots for `specs`, nothing loaded yet.
    pub fn new(specs: &[TokenizerSpec], limits: Limits) -> Tokenizers {
        let slots = specs
            .iter()
            .map(|spec| {
                let slot = Slot {
                    spec: spec.clone(),
                    loaded: OnceLock::new(),
                };
                (spec.model.clone(), Arc::new(slot))
            })
            .collect();
        Tokenizers { slots, limits }
    }

    /// Whether `model` has a tokenizer configured.
    pub fn has(&self, model: &str) -> bool {
        self.slots.contains_key(model)
    }

    /// The configured models.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.slots.keys().map(String::as_str)
    }

    /// Loads every tokenizer now (blocking: call at start).
    ///
    /// # Errors
    /// The first model whose directory does not load, with the loader's message.
    pub fn load_all(&self, metrics: &Metrics) -> Result<(), TokenizeError> {
        for slot in self.slots.values() {
            if let Err(message) = load(slot, self.limits, metrics) {
                return Err(TokenizeError::Unavailable {
                    model: slot.spec.model.clone(),
                    message,
                });
            }
        }
        Ok(())
    }

    /// Token ids of `input` with `model`'s tokenizer, counted and timed in `metrics`.
    ///
    /// # Errors
    /// See [`TokenizeError`]; each is counted by kind.
    pub async fn encode(
        &self,
        model: &str,
        input: TextInput,
        endpoint: &'static str,
        metrics: &Metrics,
    ) -> Result<Vec<u32>, TokenizeError> {
        metrics
            .text_requests
            .get_or_create(&TextLabels {
                endpoint,
                input: input.label(),
            })
            .inc();
        let result = self.encode_uncounted(model, input, metrics).await;
        if let Err(e) = &result {
            metrics
                .text_errors
                .get_or_create(&ReasonLabels { reason: e.kind() })
                .inc();
        }
        result
    }

    async fn encode_uncounted(
        &self,
        model: &str,
        input: TextInput,
        metrics: &Metrics,
    ) -> Result<Vec<u32>, TokenizeError> {
        let slot = self
            .slots
            .get(model)
            .cloned()
            .ok_or_else(|| TokenizeError::NoTokenizer(model.to_owned()))?;
        // Refuse oversized prompts before a thread is taken for them.
        if let TextInput::Prompt(p) = &input {
            if p.len() > self.limits.max_text_bytes {
                return Err(TextError::TooLarge {
                    what: "the prompt",
                    bytes: p.len(),
                    limit: self.limits.max_text_bytes,
                }
                .into());
            }
        }
        let limits = self.limits;
        let loads = metrics.tokenizers_loaded.clone();
        let started = Instant::now();
        // A loaded tokenizer encodes a text this small in well under a millisecond (the fast
        // path): cheaper here than a hop to the blocking pool, whose thread may have to start.
        let loaded = slot.loaded.get().is_some_and(|t| t.is_ok());
        let result = if loaded && input.fits(INLINE_TEXT_BYTES) {
            tokenize(&slot, input, limits, &loads)
        } else {
            tokio::task::spawn_blocking(move || tokenize(&slot, input, limits, &loads))
                .await
                .map_err(|e| TokenizeError::Internal(e.to_string()))?
        };
        metrics
            .tokenize_seconds
            .observe(started.elapsed().as_secs_f64());
        result
    }
}

/// Largest text tokenized on the async worker itself (about 12k tokens of English).
const INLINE_TEXT_BYTES: usize = 64 << 10;

/// Loads `slot`'s tokenizer if needed and encodes `input`: blocking work.
fn tokenize(
    slot: &Slot,
    input: TextInput,
    limits: Limits,
    loads: &prometheus_client::metrics::counter::Counter,
) -> Result<Vec<u32>, TokenizeError> {
    let tokenizer = match slot.loaded.get() {
        Some(Ok(t)) => t.clone(),
        _ => load_counted(slot, limits, loads).map_err(|message| TokenizeError::Unavailable {
            model: slot.spec.model.clone(),
            message,
        })?,
    };
    let ids = match input {
        TextInput::Prompt(prompt) => tokenizer.encode(&prompt)?,
        TextInput::Messages {
            messages,
            add_generation_prompt,
        } => {
            let messages = parse_messages(&messages, &limits)?;
            tokenizer.encode_chat(&messages, add_generation_prompt)?
        }
    };
    Ok(ids)
}

fn load(slot: &Slot, limits: Limits, metrics: &Metrics) -> Result<Arc<Tokenizer>, String> {
    load_counted(slot, limits, &metrics.tokenizers_loaded)
}

/// Loads the slot's tokenizer unless it is loaded (or failed) already: once per model.
fn load_counted(
    slot: &Slot,
    limits: Limits,
    loads: &prometheus_client::metrics::counter::Counter,
) -> Result<Arc<Tokenizer>, String> {
    slot.loaded
        .get_or_init(|| {
            let started = Instant::now();
            match Tokenizer::from_dir(&slot.spec.dir) {
                Ok(t) => {
                    loads.inc();
                    tracing::info!(
                        model = %slot.spec.model,
                        dir = %slot.spec.dir.display(),
                        chat_template = t.has_chat_template(),
                        took_ms = started.elapsed().as_millis() as u64,
                        "tokenizer loaded"
                    );
                    Ok(Arc::new(t.with_limits(limits)))
                }
                Err(e) => {
                    tracing::error!(model = %slot.spec.model, error = %e, "tokenizer failed to load");
                    Err(e.to_string())
                }
            }
        })
        .clone()
}

/// `POST /tokenize`: `{"model", "prompt"}` or `{"model", "messages", "add_generation_prompt"?}`.
#[derive(Debug, serde::Deserialize)]
pub struct TokenizeRequest {
    #[serde(alias = "model_name")]
    pub model: String,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Value>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
}

/// `POST /tokenize` answer.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct TokenizeResponse {
    pub model: String,
    pub token_ids: Vec<u32>,
    pub count: usize,
}

/// `POST /query` with text: the token-id query's fields with `prompt` or `messages` in place
/// of `token_ids`.
#[derive(Debug, serde::Deserialize)]
pub struct TextQueryRequest {
    /// Only to refuse a body that also carries ids.
    #[serde(default)]
    pub token_ids: Option<serde::de::IgnoredAny>,
    #[serde(alias = "model", alias = "modelname")]
    pub model_name: String,
    #[serde(default)]
    pub tenant_id: Option<StringOrNumber>,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default, alias = "additionalsalt", alias = "additional_salt")]
    pub cache_salt: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Value>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
}

/// A tenant id sent as a string or a number, as the token-id `/query` accepts it.
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
pub enum StringOrNumber {
    String(String),
    Number(serde_json::Number),
}

impl StringOrNumber {
    pub fn into_string(self) -> String {
        match self {
            StringOrNumber::String(s) => s,
            StringOrNumber::Number(n) => n.to_string(),
        }
    }
}

/// Whether a `/query` body is a text query (has a non-null `prompt` or `messages`): decided
/// without building anything, so token-id bodies the fast path declined keep their old parse
/// and errors.
pub fn is_text_query(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        #[serde(default)]
        prompt: Option<serde::de::IgnoredAny>,
        #[serde(default)]
        messages: Option<serde::de::IgnoredAny>,
    }
    serde_json::from_slice::<Probe>(body).is_ok_and(|p| p.prompt.is_some() || p.messages.is_some())
}

/// The text input of a request with `prompt` or `messages`: exactly one of them.
///
/// # Errors
/// Neither or both given (the message names the fields).
pub fn text_input(
    prompt: Option<String>,
    messages: Option<Value>,
    add_generation_prompt: Option<bool>,
) -> Result<TextInput, &'static str> {
    match (prompt, messages) {
        (Some(prompt), None) => Ok(TextInput::Prompt(prompt)),
        (None, Some(messages)) => Ok(TextInput::Messages {
            messages,
            // vLLM's default for chat completions.
            add_generation_prompt: add_generation_prompt.unwrap_or(true),
        }),
        _ => Err("give exactly one of token_ids, prompt, messages"),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::TextInput;

    #[test]
    fn the_inline_size_counts_every_string_of_the_messages() {
        let messages = |content: serde_json::Value| TextInput::Messages {
            messages: json!([{"role": "user", "content": content}]),
            add_generation_prompt: true,
        };
        // "user" + 10 bytes of content: keys are not counted, every string value is.
        assert!(messages(json!("0123456789")).fits(14));
        assert!(!messages(json!("0123456789")).fits(13));
        let parts =
            messages(json!([{"type": "text", "text": "abcdef"}, {"type": "text", "text": "gh"}]));
        // "user", then "text" + "abcdef" and "text" + "gh".
        assert!(parts.fits(4 + 4 + 6 + 4 + 2));
        assert!(!parts.fits(4 + 4 + 6 + 4 + 1));
        assert!(TextInput::Prompt("abc".into()).fits(3));
        assert!(!TextInput::Prompt("abcd".into()).fits(3));
    }
}
