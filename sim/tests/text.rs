//! Text with the real Qwen3 tokenizer (`--tokenizer`): completions prompts, chat completions
//! (plain and streamed) and `/tokenize` give the ids the reference records, and the prefix
//! cache reuses a chat's blocks; without a tokenizer the toy one still serves chat.

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_sim::cache::CacheConfig;
use kvroute_sim::engine::{EngineConfig, HEADER_CACHED_TOKENS};
use kvroute_sim::tokenizer::TextTokenizer;
use serde_json::{json, Value};

use crate::http::serve;

fn qwen3() -> TextTokenizer {
    static T: OnceLock<TextTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizer/qwen3");
        TextTokenizer::from_dir(&dir).expect("load the Qwen3 tokenizer")
    })
    .clone()
}

fn config(tokenizer: TextTokenizer) -> EngineConfig {
    EngineConfig {
        name: "text".into(),
        cache: CacheConfig {
            block_size_tokens: 4,
            capacity_blocks: 1000,
        },
        speed: 1000.0,
        tokenizer,
        ..EngineConfig::default()
    }
}

const CHAT_IDS: [u32; 19] = [
    151644, 8948, 198, 2610, 525, 50537, 13, 151645, 198, 151644, 872, 198, 9707, 1879, 151645,
    198, 151644, 77091, 198,
];

/// POSTs `body` as JSON and returns the JSON answer.
async fn post_json(c: &reqwest::Client, url: &str, body: &Value) -> Value {
    c.post(url)
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn chat() -> Value {
    json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world"}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_prompts_use_the_real_tokenizer() {
    let (_e, url) = serve(config(qwen3())).await;
    let c = reqwest::Client::new();
    let v: Value = post_json(&c, &format!("{url}/tokenize"), &json!({"messages": chat()})).await;
    assert_eq!(v["tokens"], json!(CHAT_IDS));
    let v: Value = post_json(
        &c,
        &format!("{url}/tokenize"),
        &json!({"prompt": "Hello world"}),
    )
    .await;
    assert_eq!(v["tokens"], json!([9707, 1879]));

    for expect_cached in [0u64, 16] {
        let r = c
            .post(format!("{url}/v1/chat/completions"))
            .json(&json!({"model": "m", "messages": chat(), "max_completion_tokens": 3}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let cached: u64 = r.headers()[HEADER_CACHED_TOKENS]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            cached, expect_cached,
            "the second chat reuses 4 full blocks"
        );
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["usage"]["prompt_tokens"], 19);
        assert_eq!(v["usage"]["completion_tokens"], 3);
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    }

    // The rendered chat sent as a completions prompt is the same ids: all cached but the tail.
    let text = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n";
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": text, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()[HEADER_CACHED_TOKENS], "16");

    // Streaming: chunks with deltas, the role first, then [DONE].
    let body = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"messages": chat(), "max_tokens": 3, "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<&str> = body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let first: Value = serde_json::from_str(events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let second: Value = serde_json::from_str(events[1]).unwrap();
    assert!(second["choices"][0]["delta"].get("role").is_none());

    // Bad messages are a 400 with an OpenAI error body.
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("not text"),
        "{v}"
    );
}

#[tokio::test]
async fn without_a_tokenizer_chat_uses_the_toy_one() {
    let (_e, url) = serve(config(TextTokenizer::Toy)).await;
    let c = reqwest::Client::new();
    let v: Value = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "t1 t2 t3"}], "max_tokens": 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    // "user: t1 t2 t3\n": the word "user:" hashes, then the three ids.
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    let v: Value = post_json(&c, &format!("{url}/tokenize"), &json!({"prompt": "t5 t6"})).await;
    assert_eq!(v["tokens"], json!([5, 6]));
}
