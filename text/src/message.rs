//! OpenAI chat messages, reduced to what a chat template renders.

use serde_json::{Map, Value};

use crate::error::TextError;
use crate::limits::Limits;

/// One chat message with its content as plain text.
///
/// `extra` keeps the message's other fields verbatim (`name`, `tool_calls`, `tool_call_id`,
/// `reasoning_content`, ...): templates read them, as they do in vLLM.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The text content (text parts joined by `\n`, as vLLM joins them for string templates).
    pub content: String,
    /// Every other field of the message object.
    pub extra: Map<String, Value>,
}

impl Message {
    /// A message with text content and nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
            extra: Map::new(),
        }
    }
}

/// Parses an OpenAI `messages` array.
///
/// Content is a string, `null`/absent (an assistant turn with only tool calls: empty text), or
/// an array of parts `{"type": "text", "text": ...}` joined by `\n`. Any other part (images,
/// audio) or shape is an error: routing on text that leaves parts out would hash a prompt the
/// engine never sees. The count and the total content bytes are checked against `limits` while
/// parsing, before any tokenizing.
pub fn parse_messages(value: &Value, limits: &Limits) -> Result<Vec<Message>, TextError> {
    let items = value
        .as_array()
        .ok_or_else(|| bad(0, "messages must be an array"))?;
    if items.len() > limits.max_messages {
        return Err(TextError::TooManyMessages {
            count: items.len(),
            limit: limits.max_messages,
        });
    }
    let mut out = Vec::with_capacity(items.len());
    let mut total_bytes = 0usize;
    for (index, item) in items.iter().enumerate() {
        let object = item
            .as_object()
            .ok_or_else(|| bad(index, "a message must be an object"))?;
        let role = match object.get("role") {
            Some(Value::String(role)) if !role.is_empty() => role.clone(),
            Some(_) => return Err(bad(index, "role must be a non-empty string")),
            None => return Err(bad(index, "role is missing")),
        };
        let content = match object.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(text)) => text.clone(),
            Some(Value::Array(parts)) => join_parts(index, parts)?,
            Some(_) => return Err(bad(index, "content must be a string or an array of parts")),
        };
        total_bytes = total_bytes.saturating_add(content.len());
        if total_bytes > limits.max_text_bytes {
            return Err(TextError::TooLarge {
                what: "the messages' content",
                bytes: total_bytes,
                limit: limits.max_text_bytes,
            });
        }
        let extra = object
            .iter()
            .filter(|(key, _)| key.as_str() != "role" && key.as_str() != "content")
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        out.push(Message {
            role,
            content,
            extra,
        });
    }
    Ok(out)
}

fn join_parts(index: usize, parts: &[Value]) -> Result<String, TextError> {
    let mut text = String::new();
    for (n, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str);
        let piece = match (kind, part.get("text")) {
            (Some("text"), Some(Value::String(piece))) => piece,
            (Some("text"), _) => {
                return Err(bad(index, &format!("content[{n}]: text must be a string")))
            }
            (Some(other), _) => {
                return Err(bad(
                    index,
                    &format!("content[{n}]: part type {other:?} is not text"),
                ))
            }
            (None, _) => return Err(bad(index, &format!("content[{n}]: type is missing"))),
        };
        if n > 0 {
            text.push('\n');
        }
        text.push_str(piece);
    }
    Ok(text)
}

fn bad(index: usize, reason: &str) -> TextError {
    TextError::BadMessage {
        index,
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> Limits {
        Limits::default()
    }

    #[test]
    fn text_parts_are_joined_by_newline_and_extras_kept() {
        let v = json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f"}}]}
        ]);
        let m = parse_messages(&v, &limits()).unwrap();
        assert_eq!(m[0].content, "a\nb");
        assert_eq!(m[1].content, "");
        assert!(m[1].extra.contains_key("tool_calls"));
    }

    #[test]
    fn non_text_parts_and_bad_shapes_are_refused() {
        for v in [
            json!({"role": "user"}),
            json!([1]),
            json!([{"content": "x"}]),
            json!([{"role": 3, "content": "x"}]),
            json!([{"role": "user", "content": 5}]),
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            json!([{"role": "user", "content": [{"type": "text", "text": 7}]}]),
            json!([{"role": "user", "content": ["bare string"]}]),
        ] {
            let err = parse_messages(&v, &limits()).unwrap_err();
            assert_eq!(err.kind(), "bad_messages", "{v}");
        }
    }
}
