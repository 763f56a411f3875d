//! Text for kvroute: a model's Hugging Face tokenizer (`tokenizer.json`) and chat template
//! (`tokenizer_config.json`), rendered and encoded the way vLLM does, so a text request hashes
//! to the same KV blocks as the engine computes for it.
//!
//! - [`Tokenizer::encode`]: a completions prompt, special tokens added by the tokenizer's own
//!   rule (its post-processor: BOS for Llama-style models, nothing for Qwen);
//! - [`Tokenizer::render_chat`] / [`Tokenizer::encode_chat`]: chat messages through the
//!   template (`bos_token`, `eos_token`, `add_generation_prompt` in the context, special tokens
//!   written as text), then encoded WITHOUT adding special tokens again;
//! - [`parse_messages`]: OpenAI `messages` JSON (string content or text parts) into
//!   [`Message`]s, refusing anything else;
//! - [`synth::block_text`]: deterministic text blocks for replaying token-id traces as text.
//!
//! Every size limit ([`Limits`]) is checked before any tokenizing, and no input panics: the
//! tokenizer and the template engine run behind `catch_unwind`, templates with a fuel bound.

mod bpe;
mod error;
mod limits;
mod message;
mod pretokenize;
mod segments;
pub mod synth;
mod template;
mod tokenizer;

pub use error::{LoadError, TextError};
pub use limits::Limits;
pub use message::{parse_messages, Message};
pub use tokenizer::Tokenizer;
