//! Size limits of text requests: their own file, since parsing and tokenizing both read them.

/// Size limits, checked before any tokenizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes of a prompt or of all messages' content together; a rendered chat may be
    /// twice this (template boilerplate around many short messages).
    pub max_text_bytes: usize,
    /// Most messages in one chat.
    pub max_messages: usize,
}

impl Default for Limits {
    /// 1 MiB of text (about 250k tokens, the collector's default `--max-query-tokens`) and
    /// 2,048 messages.
    fn default() -> Self {
        Limits {
            max_text_bytes: 1 << 20,
            max_messages: 2048,
        }
    }
}
