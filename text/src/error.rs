//! The errors of loading a tokenizer and of turning text into token ids.

use std::path::PathBuf;

/// Loading a model's tokenizer directory failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `tokenizer.json` is not a tokenizer the `tokenizers` crate can load.
    #[error("loading tokenizer {path}: {message}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// What the `tokenizers` crate said.
        message: String,
    },
    /// `tokenizer_config.json` is not valid JSON of the expected shape.
    #[error("parsing {path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The chat template does not compile.
    #[error("compiling the chat template of {path}: {message}")]
    Template {
        /// The file the template came from.
        path: PathBuf,
        /// The template engine's error.
        message: String,
    },
}

/// Turning a prompt or messages into token ids failed; the request is at fault (4xx).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TextError {
    /// The text (prompt, the messages' contents, or the rendered chat) is over the byte limit.
    #[error("{what} is {bytes} bytes, over the limit of {limit}")]
    TooLarge {
        /// Which text.
        what: &'static str,
        /// Its size.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// More messages than the limit.
    #[error("{count} messages, over the limit of {limit}")]
    TooManyMessages {
        /// How many were sent (counted up to the first one past the limit).
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// `messages` is not an array of OpenAI chat messages with text content.
    #[error("messages[{index}]: {reason}")]
    BadMessage {
        /// Position of the offending message (0 when `messages` itself is wrong).
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The model has no chat template, so messages cannot be rendered.
    #[error("the model's tokenizer has no chat template")]
    NoChatTemplate,
    /// The chat template failed on these messages (`raise_exception`, a type error, fuel).
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer failed on the text.
    #[error("tokenizer: {0}")]
    Encode(String),
}

impl TextError {
    /// A short, stable name of the error kind, for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            TextError::TooLarge { .. } | TextError::TooManyMessages { .. } => "too_large",
            TextError::BadMessage { .. } => "bad_messages",
            TextError::NoChatTemplate => "no_template",
            TextError::Template(_) => "template",
            TextError::Encode(_) => "encode",
        }
    }

    /// Whether the error is about size (an HTTP 413) rather than content (422).
    pub fn is_too_large(&self) -> bool {
        matches!(
            self,
            TextError::TooLarge { .. } | TextError::TooManyMessages { .. }
        )
    }
}
