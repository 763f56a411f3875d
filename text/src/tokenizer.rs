//! A model's tokenizer: `tokenizer.json` through the `tokenizers` crate, and the chat template
//! and special tokens of `tokenizer_config.json` (or `chat_template.jinja` beside it).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::bpe::FastPath;
use crate::error::{LoadError, TextError};
use crate::limits::Limits;
use crate::message::Message;
use crate::segments::Segmenter;
use crate::template::{ChatTemplate, SpecialTokens};

/// A model's tokenizer and chat template. `Send + Sync`: share one behind an `Arc`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    special: SpecialTokens,
    limits: Limits,
    /// Piecewise encoding with a cache of pieces, where that is exact.
    segmenter: Option<Segmenter>,
    /// The pieces' encoder without backtracking, where that is exact (with the segmenter only).
    fast: Option<FastPath>,
}

/// Memory for cached pieces per tokenizer: about a million tokens of conversation turns.
const PIECE_CACHE_BYTES: usize = 32 << 20;

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("chat_template", &self.template.is_some())
            .field("limits", &self.limits)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json` (special
    /// tokens, `chat_template`) and `dir/chat_template.jinja` (which wins over the config's
    /// template, as in `transformers`). Default [`Limits`].
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, LoadError> {
        let dir = dir.as_ref();
        let json_path = dir.join("tokenizer.json");
        let mut inner =
            tokenizers::Tokenizer::from_file(&json_path).map_err(|e| LoadError::Tokenizer {
                path: json_path.clone(),
                message: e.to_string(),
            })?;
        // A request is encoded whole: a truncation or padding rule in the file would make the
        // ids differ from the engine's.
        inner
            .with_truncation(None)
            .map_err(|e| LoadError::Tokenizer {
                path: json_path.clone(),
                message: e.to_string(),
            })?
            .with_padding(None);

        let config_path = dir.join("tokenizer_config.json");
        let config =
            match std::fs::read(&config_path) {
                Ok(bytes) => Some(serde_json::from_slice::<Value>(&bytes).map_err(|e| {
                    LoadError::Config {
                        path: config_path.clone(),
                        message: e.to_string(),
                    }
                })?),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(source) => {
                    return Err(LoadError::Io {
                        path: config_path,
                        source,
                    })
                }
            };
        let special = config
            .as_ref()
            .map(|c| SpecialTokens {
                bos_token: token_field(c, "bos_token"),
                eos_token: token_field(c, "eos_token"),
                unk_token: token_field(c, "unk_token"),
                pad_token: token_field(c, "pad_token"),
            })
            .unwrap_or_default();

        let jinja_path = dir.join("chat_template.jinja");
        let (source, source_path): (Option<String>, PathBuf) =
            match std::fs::read_to_string(&jinja_path) {
                Ok(text) => (Some(text), jinja_path),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => (
                    config
                        .as_ref()
                        .map(|c| config_template(c, &config_path))
                        .transpose()?
                        .flatten(),
                    config_path.clone(),
                ),
                Err(source) => {
                    return Err(LoadError::Io {
                        path: jinja_path,
                        source,
                    })
                }
            };
        let template = source
            .map(|s| {
                ChatTemplate::compile(s).map_err(|message| LoadError::Template {
                    path: source_path,
                    message,
                })
            })
            .transpose()?;
        let segmenter = Segmenter::build(&inner, PIECE_CACHE_BYTES);
        let fast = segmenter.as_ref().and_then(|_| FastPath::build(&inner));
        Ok(Tokenizer {
            inner,
            template,
            special,
            limits: Limits::default(),
            segmenter,
            fast,
        })
    }

    /// The same tokenizer with other limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Whether texts are encoded piece by piece between added tokens with a cache of the
    /// pieces (exact for this tokenizer; see the `segments` module).
    pub fn caches_pieces(&self) -> bool {
        self.segmenter.is_some()
    }

    /// Whether pieces are split by the automaton instead of `tokenizers`' backtracking regex
    /// (exact for this tokenizer; see the `pretokenize` module).
    pub fn splits_fast(&self) -> bool {
        self.fast.is_some()
    }

    /// Encodes with `tokenizers` in one pass, no piece cache (tests compare the two).
    pub fn encode_uncached(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TextError> {
        let encoded = catch_unwind(AssertUnwindSafe(|| {
            self.inner.encode_fast(text, add_special_tokens)
        }));
        match encoded {
            Ok(Ok(encoding)) => Ok(encoding.get_ids().to_vec()),
            Ok(Err(e)) => Err(TextError::Encode(e.to_string())),
            Err(_) => Err(TextError::Encode("the tokenizer panicked".into())),
        }
    }

    /// Whether chat messages can be rendered.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Encodes a completions prompt as vLLM does: special tokens added by the tokenizer's own
    /// rule (its post-processor).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.check_text("the prompt", text, self.limits.max_text_bytes)?;
        self.encode_raw(text, true)
    }

    /// Renders `messages` through the chat template as vLLM does (special tokens as text).
    pub fn render_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let template = self.template.as_ref().ok_or(TextError::NoChatTemplate)?;
        if messages.len() > self.limits.max_messages {
            return Err(TextError::TooManyMessages {
                count: messages.len(),
                limit: self.limits.max_messages,
            });
        }
        let content_bytes = messages
            .iter()
            .fold(0usize, |sum, m| sum.saturating_add(m.content.len()));
        if content_bytes > self.limits.max_text_bytes {
            return Err(TextError::TooLarge {
                what: "the messages' content",
                bytes: content_bytes,
                limit: self.limits.max_text_bytes,
            });
        }
        let text = template.render(messages, add_generation_prompt, &self.special)?;
        self.check_text(
            "the rendered chat",
            &text,
            self.limits.max_text_bytes.saturating_mul(2),
        )?;
        Ok(text)
    }

    /// Renders and encodes `messages`: the template already wrote the special tokens, so none
    /// are added (vLLM's `add_special_tokens=False` for chat).
    pub fn encode_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TextError> {
        let text = self.render_chat(messages, add_generation_prompt)?;
        self.encode_raw(&text, false)
    }

    /// Encodes `text` with or without the post-processor's special tokens. No size check:
    /// callers check first.
    pub fn encode_raw(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        // `tokenizers` reports errors as values; the guard keeps a panic on some unforeseen
        // input from taking the process down.
        let encoded = catch_unwind(AssertUnwindSafe(|| match &self.segmenter {
            // Exact for both: the segmenter exists only where no special tokens are added.
            Some(segmenter) => segmenter.encode(text, &|piece| match &self.fast {
                Some(fast) => fast.encode(&self.inner, piece),
                None => Ok(self.inner.encode_fast(piece, false)?.get_ids().to_vec()),
            }),
            None => self
                .inner
                .encode_fast(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec()),
        }));
        match encoded {
            Ok(Ok(ids)) => Ok(ids),
            Ok(Err(e)) => Err(TextError::Encode(e.to_string())),
            Err(_) => Err(TextError::Encode("the tokenizer panicked".into())),
        }
    }

    fn check_text(&self, what: &'static str, text: &str, limit: usize) -> Result<(), TextError> {
        if text.len() > limit {
            return Err(TextError::TooLarge {
                what,
                bytes: text.len(),
                limit,
            });
        }
        Ok(())
    }
}

/// A special token in `tokenizer_config.json`: a string, or an `AddedToken` object.
fn token_field(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template`: a string, or a list of `{name, template}` of which `default` is used.
fn config_template(config: &Value, path: &Path) -> Result<Option<String>, LoadError> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => Ok(list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned)),
        Some(_) => Err(LoadError::Config {
            path: path.to_owned(),
            message: "chat_template must be a string or a list of {name, template}".into(),
        }),
    }
}
