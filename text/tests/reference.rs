//! The Rust path gives exactly what the reference implementation recorded.

use kvroute_text::{parse_messages, Limits, Message};
use serde_json::{json, Value};

use crate::{qwen3, qwen3_dir};

fn reference() -> Value {
    let text = std::fs::read_to_string(qwen3_dir().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

#[test]
fn the_briefs_check_renders_and_encodes_exactly() {
    let messages = [
        Message::new("system", "You are terse."),
        Message::new("user", "Hello world"),
    ];
    let text = qwen3().render_chat(&messages, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        qwen3().encode_chat(&messages, true).unwrap(),
        [
            151644, 8948, 198, 2610, 525, 50537, 13, 151645, 198, 151644, 872, 198, 9707, 1879,
            151645, 198, 151644, 77091, 198
        ]
    );
}

#[test]
fn known_strings_encode_to_the_reference_ids() {
    let reference = reference();
    let cases = reference["encode"].as_array().unwrap();
    assert!(cases.len() >= 15);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        assert_eq!(qwen3().encode(text).unwrap(), ids(&case["ids"]), "{text:?}");
        assert_eq!(
            qwen3().encode_raw(text, false).unwrap(),
            ids(&case["ids_no_special"]),
            "{text:?} without special tokens"
        );
    }
}

#[test]
fn chat_templates_render_and_encode_as_the_reference() {
    let reference = reference();
    let cases = reference["chat"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let messages = parse_messages(&case["messages"], &Limits::default()).unwrap();
        let text = qwen3().render_chat(&messages, add).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "{name} add={add}");
        assert_eq!(
            qwen3().encode_chat(&messages, add).unwrap(),
            ids(&case["ids"]),
            "{name} add={add}"
        );
    }
}

#[test]
fn content_parts_render_as_their_joined_text() {
    let parts = json!([
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]}
    ]);
    let plain = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "line one\nline two"}
    ]);
    let limits = Limits::default();
    let a = qwen3()
        .encode_chat(&parse_messages(&parts, &limits).unwrap(), true)
        .unwrap();
    let b = qwen3()
        .encode_chat(&parse_messages(&plain, &limits).unwrap(), true)
        .unwrap();
    assert_eq!(a, b);
    assert!(a.len() > 10);
}

#[test]
fn a_completions_prompt_gets_no_bos_from_qwen3() {
    // Qwen3's post-processor adds nothing: the prompt's ids are the text's ids.
    let ids = qwen3().encode("<|im_start|>user\nhi").unwrap();
    assert_eq!(ids.first(), Some(&151644));
}

#[test]
fn piecewise_cached_encoding_equals_one_pass_encoding() {
    assert!(qwen3().caches_pieces());
    let reference = reference();
    let mut texts: Vec<String> = reference["encode"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_owned())
        .collect();
    texts.extend(
        reference["chat"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_owned()),
    );
    texts.push("<think>\nlong reasoning that is certainly longer than the cache's minimum piece\n</think>\n\n<tool_call>{\"a\": 1}</tool_call><|im_end|>".into());
    texts.push(kvroute_text::synth::trace_text(&[1, 2]));
    // Twice: the second pass reads the pieces from the cache.
    for _ in 0..2 {
        for text in &texts {
            assert_eq!(
                qwen3().encode_raw(text, false).unwrap(),
                qwen3().encode_uncached(text, false).unwrap(),
                "{text:?}"
            );
            assert_eq!(
                qwen3().encode(text).unwrap(),
                qwen3().encode_uncached(text, true).unwrap(),
                "{text:?}"
            );
        }
    }
}
