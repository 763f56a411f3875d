//! Limits and bad input: errors, never panics.

use std::time::Instant;

use kvroute_text::{parse_messages, Limits, Message, TextError, Tokenizer};
use serde_json::{json, Value};

use crate::{qwen3, qwen3_dir};

#[test]
fn ten_megabytes_of_text_are_refused_before_tokenizing() {
    let text = "a".repeat(10 << 20);
    // Loaded outside the timed part: the first test to ask loads the 11 MB tokenizer.
    let tokenizer = qwen3();
    let start = Instant::now();
    let err = tokenizer.encode(&text).unwrap_err();
    assert!(
        matches!(err, TextError::TooLarge { bytes, .. } if bytes == 10 << 20),
        "{err}"
    );
    assert!(err.is_too_large());
    // Refused by the size check, not after a tokenizer pass over 10 MB (which takes many
    // seconds); the bound leaves room for a loaded machine.
    assert!(start.elapsed().as_millis() < 1000, "{:?}", start.elapsed());

    let messages = json!([{"role": "user", "content": text}]);
    let err = parse_messages(&messages, &Limits::default()).unwrap_err();
    assert!(err.is_too_large(), "{err}");
    let err = qwen3()
        .render_chat(&[Message::new("user", text)], true)
        .unwrap_err();
    assert!(err.is_too_large(), "{err}");
}

#[test]
fn ten_thousand_messages_are_refused() {
    let many: Vec<Value> = (0..10_000)
        .map(|i| json!({"role": "user", "content": format!("m{i}")}))
        .collect();
    let err = parse_messages(&Value::Array(many), &Limits::default()).unwrap_err();
    assert!(
        matches!(
            err,
            TextError::TooManyMessages {
                count: 10_000,
                limit: 2048
            }
        ),
        "{err}"
    );
    let messages: Vec<Message> = (0..10_000)
        .map(|i| Message::new("user", format!("m{i}")))
        .collect();
    assert!(qwen3()
        .render_chat(&messages, true)
        .unwrap_err()
        .is_too_large());
}

#[test]
fn the_largest_allowed_chat_renders() {
    // 2,048 messages at the limit: within the template's fuel.
    let messages: Vec<Message> = (0..2048)
        .map(|i| {
            Message::new(
                if i % 2 == 0 { "user" } else { "assistant" },
                format!("turn {i}"),
            )
        })
        .collect();
    let ids = qwen3().encode_chat(&messages, true).unwrap();
    assert!(ids.len() > 2048 * 5);
}

#[test]
fn odd_text_tokenizes_without_panicking() {
    let long_word = "x".repeat(200_000);
    let texts = [
        "\u{0}\u{1}\u{7f}",
        "\u{301}\u{301}\u{301} lone combining marks",
        "\u{feff}\u{200b}\u{2028}\u{2029}",
        "\u{10ffff}\u{e000}",
        long_word.as_str(),
        "<|im_end|><|im_end|><|endoftext|>",
    ];
    for text in texts {
        let ids = qwen3().encode(text).unwrap();
        assert!(!ids.is_empty(), "{text:?}");
    }
}

#[test]
fn a_template_failure_is_an_error_not_a_panic() {
    // Qwen3's template calls `.startswith` on user content: a message whose extra fields
    // shadow nothing still renders, and a role the template ignores renders nothing for it.
    let messages = [
        Message::new("narrator", "ignored"),
        Message::new("user", "hi"),
    ];
    let text = qwen3().render_chat(&messages, false).unwrap();
    assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n");
    // An empty message list: the template reads `messages[0].role`, an error in jinja2 as here.
    let err = qwen3().render_chat(&[], true).unwrap_err();
    assert_eq!(err.kind(), "template", "{err}");
}

#[test]
fn a_directory_without_a_template_refuses_chat_but_encodes_prompts() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        qwen3_dir().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(!tokenizer.has_chat_template());
    assert_eq!(tokenizer.encode("Hello world").unwrap(), [9707, 1879]);
    let err = tokenizer
        .render_chat(&[Message::new("user", "x")], true)
        .unwrap_err();
    assert_eq!(err.kind(), "no_template");
}

#[test]
fn a_broken_template_or_missing_file_fails_the_load_with_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    std::fs::copy(
        qwen3_dir().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{% for m in messages %}"}"#,
    )
    .unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("chat template"), "{err}");
}

#[test]
fn limits_are_configurable() {
    let tokenizer = Tokenizer::from_dir(qwen3_dir())
        .unwrap()
        .with_limits(Limits {
            max_text_bytes: 8,
            max_messages: 1,
        });
    assert!(tokenizer.encode("123456789").unwrap_err().is_too_large());
    assert!(tokenizer.encode("12345678").is_ok());
    let two = [Message::new("user", "a"), Message::new("user", "b")];
    assert!(tokenizer
        .encode_chat(&two, true)
        .unwrap_err()
        .is_too_large());
}
