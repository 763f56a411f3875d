//! `/tokenize` and `/query` with `prompt` or `messages`, on the real Qwen3 tokenizer in
//! testdata/: the ids match the reference, a text query answers exactly as the token-id query
//! of those ids, and every bad input is a JSON 4xx.

use std::path::PathBuf;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use kvroute_collector::config::TokenizerSpec;
use kvroute_collector::decode::decode;
use kvroute_collector::{app, AppState, Config, Shared};
use kvroute_sim::wire::{encode_events, stored, EventFormat, Extras};
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::common::config;

const MODEL: &str = "qwen3";

fn qwen3_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizer/qwen3")
}

fn text_config() -> Config {
    Config {
        tokenizers: vec![TokenizerSpec {
            model: MODEL.into(),
            dir: qwen3_dir(),
        }],
        ..config()
    }
}

async fn call(state: &AppState, method: Method, uri: &str, body: String) -> (StatusCode, String) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let res = app(state.clone()).oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn post(state: &AppState, uri: &str, body: Value) -> (StatusCode, Value) {
    let (s, b) = call(state, Method::POST, uri, body.to_string()).await;
    (s, serde_json::from_str(&b).expect("every answer is JSON"))
}

fn chat() -> Value {
    json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello world"}
    ])
}

const CHAT_IDS: [u32; 19] = [
    151644, 8948, 198, 2610, 525, 50537, 13, 151645, 198, 151644, 872, 198, 9707, 1879, 151645,
    198, 151644, 77091, 198,
];

fn ids_of(v: &Value) -> Vec<u32> {
    serde_json::from_value(v["token_ids"].clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_gives_the_reference_ids_for_prompts_and_messages() {
    let state = Shared::new(text_config());
    let (s, v) = post(
        &state,
        "/tokenize",
        json!({"model": MODEL, "messages": chat()}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(ids_of(&v), CHAT_IDS);
    assert_eq!(v["count"], 19);
    assert_eq!(v["model"], MODEL);

    let (s, v) = post(
        &state,
        "/tokenize",
        json!({"model": MODEL, "messages": chat(), "add_generation_prompt": false}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(ids_of(&v), CHAT_IDS[..16]);

    let (s, v) = post(
        &state,
        "/tokenize",
        json!({"model": MODEL, "prompt": "Hello world"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(ids_of(&v), [9707, 1879]);

    // Text parts are the joined text.
    let parts = json!([{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
                       {"role": "user", "content": [{"type": "text", "text": "Hello world"}]}]);
    let (s, v) = post(
        &state,
        "/tokenize",
        json!({"model_name": MODEL, "messages": parts}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(ids_of(&v), CHAT_IDS);
}

/// A collector whose worker "w" (block size 4) holds the blocks of `ids`.
async fn holding(ids: &[u32]) -> AppState {
    let state = Shared::new(text_config());
    let (s, v) = post(
        &state,
        "/register",
        json!({"instance_id": "w", "endpoint": "tcp://127.0.0.1:1", "model_name": MODEL, "block_size": 4}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let batch = decode(&encode_events(
        EventFormat::Vllm033,
        Extras {
            vllm_group_fields: false,
        },
        1.0,
        &[stored(None, 7, ids, 4)],
        Some(0),
    ))
    .unwrap();
    let id = state.read().workers().next().unwrap().id;
    state.apply_batch(id, 0, batch).await;
    state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_query_answers_as_the_token_query_of_its_ids() {
    // The engine cached the chat without the generation prompt (the previous turn).
    let state = holding(&CHAT_IDS[..16]).await;
    let (s, by_ids) = post(
        &state,
        "/query",
        json!({"model_name": MODEL, "tenant_id": "default", "token_ids": CHAT_IDS}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{by_ids}");
    assert!(
        by_ids.to_string().contains("\"w\""),
        "the worker matches: {by_ids}"
    );

    // The filter's shape: model_name, tenant_id, and the body's messages verbatim.
    let (s, by_messages) = post(
        &state,
        "/query",
        json!({"model_name": MODEL, "tenant_id": "default", "messages": chat()}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{by_messages}");
    assert_eq!(by_messages, by_ids);

    let text = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n";
    let (s, by_prompt) = post(
        &state,
        "/query",
        json!({"model": MODEL, "tenant_id": "default", "prompt": text}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{by_prompt}");
    assert_eq!(by_prompt, by_ids);

    // A salt is a different scope: no match, exactly as for ids.
    let (_, salted_ids) = post(
        &state,
        "/query",
        json!({"model_name": MODEL, "cache_salt": "s", "token_ids": CHAT_IDS}),
    )
    .await;
    let (_, salted_text) = post(
        &state,
        "/query",
        json!({"model_name": MODEL, "cache_salt": "s", "messages": chat()}),
    )
    .await;
    assert_eq!(salted_text, salted_ids);
    assert_ne!(salted_text, by_ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_text_requests_are_json_4xx() {
    let state = Shared::new(Config {
        text_limits: kvroute_text::Limits {
            max_text_bytes: 1 << 20,
            max_messages: 100,
        },
        ..text_config()
    });
    let (s, v) = post(&state, "/query", json!({"model_name": "m", "prompt": "hi"})).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"], "no tokenizer for model \"m\"");
    let (s, v) = post(
        &state,
        "/tokenize",
        json!({"model": "m", "messages": chat()}),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"], "no tokenizer for model \"m\"");

    let cases: Vec<(Value, StatusCode)> = vec![
        // Not text parts.
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json!({"model": MODEL, "messages": "hello"}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json!({"model": MODEL, "messages": [{"content": "x"}]}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        // The Qwen3 template reads messages[0]: an empty list fails in the template.
        (
            json!({"model": MODEL, "messages": []}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json!({"model": MODEL, "prompt": 5}),
            StatusCode::BAD_REQUEST,
        ),
        (json!({"model": MODEL}), StatusCode::BAD_REQUEST),
        (
            json!({"model": MODEL, "prompt": "a", "messages": chat()}),
            StatusCode::BAD_REQUEST,
        ),
        (json!({"prompt": "a"}), StatusCode::BAD_REQUEST),
    ];
    for (body, want) in cases {
        for uri in ["/tokenize", "/query"] {
            let mut body = body.clone();
            if uri == "/query" {
                if let Some(m) = body.as_object_mut().and_then(|o| o.remove("model")) {
                    body["model_name"] = m;
                }
                if body.get("prompt").is_none() && body.get("messages").is_none() {
                    continue; // a token-id query's errors are tested in http.rs
                }
            }
            let (s, v) = post(&state, uri, body.clone()).await;
            assert_eq!(s, want, "{uri} {body} -> {v}");
            assert!(v["error"].is_string(), "{v}");
        }
    }

    // Exactly one of token_ids, prompt, messages.
    let (s, v) = post(
        &state,
        "/query",
        json!({"model_name": MODEL, "token_ids": [1, 2], "prompt": "x"}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");

    // Sizes: 413 before tokenizing.
    let many: Vec<Value> = (0..10_000)
        .map(|i| json!({"role": "user", "content": format!("m{i}")}))
        .collect();
    let (s, v) = post(
        &state,
        "/query",
        json!({"model_name": MODEL, "messages": many}),
    )
    .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    let big = "word ".repeat(300_000); // 1.5 MB: under the body limit, over the text limit
    let (s, v) = post(&state, "/tokenize", json!({"model": MODEL, "prompt": big})).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    let huge = "a".repeat(10 << 20); // 10 MB: over the body limit
    let (s, v) = post(
        &state,
        "/query",
        json!({"model_name": MODEL, "prompt": huge}),
    )
    .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");

    // Still serving, and every refusal counted by kind.
    let (s, _) = post(&state, "/tokenize", json!({"model": MODEL, "prompt": "ok"})).await;
    assert_eq!(s, StatusCode::OK);
    let (_, metrics) = call(&state, Method::GET, "/metrics", String::new()).await;
    for kind in ["no_tokenizer", "bad_messages", "too_large", "template"] {
        assert!(
            metrics.contains(&format!("kvroute_text_errors_total{{reason=\"{kind}\"}}")),
            "{kind} missing from\n{metrics}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_is_loaded_once_and_at_start() {
    let state = Shared::new(text_config());
    let calls = (0..8).map(|i| {
        let state = state.clone();
        async move {
            post(
                &state,
                "/tokenize",
                json!({"model": MODEL, "prompt": format!("call {i}")}),
            )
            .await
        }
    });
    for (s, v) in futures_util::future::join_all(calls).await {
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    let (_, metrics) = call(&state, Method::GET, "/metrics", String::new()).await;
    assert!(
        metrics.contains("kvroute_tokenizers_loaded_total 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvroute_text_requests_total{endpoint=\"tokenize\",input=\"prompt\"} 8"),
        "{metrics}"
    );

    // `start` loads every tokenizer before serving; a bad directory stops it with the path.
    let started = kvroute_collector::start(text_config()).unwrap();
    assert_eq!(started.metrics.tokenizers_loaded.get(), 1);
    let bad = Config {
        tokenizers: vec![TokenizerSpec {
            model: "x".into(),
            dir: "/nonexistent/tok".into(),
        }],
        ..config()
    };
    let err = kvroute_collector::start(bad).unwrap_err().to_string();
    assert!(err.contains("/nonexistent/tok"), "{err}");
}

/// The whole exact path: a simulated engine with the same Qwen3 tokenizer serves a chat and
/// publishes KV events of the ids it computed; the collector, asked with the same messages,
/// finds the engine holding every full block of the chat's ids from `/tokenize`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_served_by_a_sim_engine_is_found_by_a_text_query() {
    use kvroute::api::RegisterRequest;
    use kvroute_sim::cache::CacheConfig;
    use kvroute_sim::engine::{Engine, EngineConfig};
    use kvroute_sim::tokenizer::TextTokenizer;

    let engine = Engine::start(EngineConfig {
        name: "e1".into(),
        model: MODEL.into(),
        cache: CacheConfig {
            block_size_tokens: 16,
            capacity_blocks: 1000,
        },
        speed: 1000.0,
        events_endpoint: Some("tcp://127.0.0.1:0".into()),
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        tokenizer: TextTokenizer::from_dir(&qwen3_dir()).unwrap(),
        ..EngineConfig::default()
    })
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = engine.app();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let state = Shared::new(text_config());
    let (endpoint, replay) = engine.event_endpoints().remove(0);
    state
        .register(RegisterRequest {
            instance_id: "e1".into(),
            endpoint,
            replay_endpoint: replay,
            model_name: MODEL.into(),
            tenant_id: None,
            block_size: 16,
            dp_rank: None,
            lora_name: None,
            cache_salt: None,
            address: Some("127.0.0.1:1".into()),
        })
        .unwrap();

    let messages = json!([
        {"role": "system", "content": "You are a careful assistant. Answer in one short paragraph, cite nothing, and never use lists."},
        {"role": "user", "content": [{"type": "text", "text": "Why do LLM servers keep a prefix cache of KV blocks?"}]},
        {"role": "assistant", "content": "So repeated prompt prefixes skip prefill."},
        {"role": "user", "content": "And how does a router use it? 路由器如何使用它？"}
    ]);
    let (s, v) = post(
        &state,
        "/tokenize",
        json!({"model": MODEL, "messages": messages}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let ids = ids_of(&v);
    assert!(ids.len() >= 64, "{} ids", ids.len());

    let client = reqwest::Client::new();
    // The engine computes the same ids.
    let engine_ids: Value = client
        .post(format!("{url}/tokenize"))
        .json(&json!({"model": MODEL, "messages": messages}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(engine_ids["tokens"], json!(ids));

    // Serve the chat (its blocks are published when admitted) until the collector sees them.
    let full_blocks = (ids.len() / 16 * 16) as u64;
    let until = tokio::time::Instant::now() + crate::common::DEADLINE;
    loop {
        let r = client
            .post(format!("{url}/v1/chat/completions"))
            .json(&json!({"model": MODEL, "messages": messages, "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["usage"]["prompt_tokens"], ids.len());
        let (s, v) = post(
            &state,
            "/query",
            json!({"model_name": MODEL, "tenant_id": "default", "messages": messages}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        if v["instances"]["e1"]["longest_matched"].as_u64() == Some(full_blocks) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the collector never matched {full_blocks} tokens: {v}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
