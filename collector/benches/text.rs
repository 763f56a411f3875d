//! The cost of text requests beside token-id ones (issue 14's target: the extra collector
//! round trip for text at most 1 ms p99 for 8k-token prompts, tokenization included).
//!
//! Through the collector's router (`app(state).oneshot`), no sockets: an index where one
//! worker holds every block of an 8,192-token prompt (block size 16) and `/query` with
//! (a) the token ids, (b) the prompt text, (c) the same text as one chat message; plus
//! `kvroute-text` alone on that text. The prompt is the Mooncake replay's text
//! (`kvroute_text::synth`, 16 blocks of 512 Qwen3 tokens). After criterion's figures, a
//! 2,000-request loop per shape prints p50 / p99 / max.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use criterion::{criterion_group, Criterion};
use http_body_util::BodyExt;
use kvroute::api::RegisterRequest;
use kvroute_collector::config::TokenizerSpec;
use kvroute_collector::decode::decode;
use kvroute_collector::{app, AppState, Config, Shared};
use kvroute_sim::wire::{encode_events, stored, EventFormat, Extras};
use serde_json::json;
use tower::ServiceExt;

const MODEL: &str = "qwen3";

fn qwen3_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizer/qwen3")
}

struct Setup {
    rt: tokio::runtime::Runtime,
    state: AppState,
    text: String,
    ids: Vec<u32>,
}

fn setup() -> Setup {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let text = kvroute_text::synth::trace_text(&(1000..1016).collect::<Vec<u64>>());
    let tokenizer = kvroute_text::Tokenizer::from_dir(qwen3_dir()).unwrap();
    let ids = tokenizer.encode(&text).unwrap();
    assert_eq!(ids.len(), 8192);
    let state = Shared::new(Config {
        tokenizers: vec![TokenizerSpec {
            model: MODEL.into(),
            dir: qwen3_dir(),
        }],
        ..Config::default()
    });
    state
        .tokenizers
        .load_all(&state.metrics)
        .expect("load the tokenizer");
    // Registering starts the worker's subscriber task: inside the runtime.
    let _runtime = rt.enter();
    state
        .register(RegisterRequest {
            instance_id: "w".into(),
            endpoint: "tcp://127.0.0.1:1".into(),
            replay_endpoint: None,
            model_name: MODEL.into(),
            tenant_id: None,
            block_size: 16,
            dp_rank: None,
            lora_name: None,
            cache_salt: None,
            address: Some("127.0.0.1:8000".into()),
        })
        .unwrap();
    let batch = decode(&encode_events(
        EventFormat::Vllm033,
        Extras {
            vllm_group_fields: false,
        },
        1.0,
        &[stored(None, 1, &ids, 16)],
        Some(0),
    ))
    .unwrap();
    let id = state.read().workers().next().unwrap().id;
    rt.block_on(state.apply_batch(id, 0, batch));
    Setup {
        rt,
        state,
        text,
        ids,
    }
}

async fn query(state: &AppState, body: &str) -> usize {
    let req = Request::post("/query")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let res = app(state.clone()).oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    res.into_body().collect().await.unwrap().to_bytes().len()
}

fn bodies(s: &Setup) -> [(&'static str, String); 3] {
    [
        (
            "token_ids",
            json!({"model_name": MODEL, "token_ids": s.ids}).to_string(),
        ),
        (
            "prompt",
            json!({"model_name": MODEL, "prompt": s.text}).to_string(),
        ),
        (
            "messages",
            json!({"model_name": MODEL, "messages": [{"role": "user", "content": s.text}]})
                .to_string(),
        ),
    ]
}

fn text_benches(c: &mut Criterion) {
    let s = setup();
    let tokenizer = kvroute_text::Tokenizer::from_dir(qwen3_dir()).unwrap();
    let mut g = c.benchmark_group("text_8k");
    g.measurement_time(Duration::from_secs(4));
    g.bench_function("encode_prompt", |b| {
        b.iter(|| tokenizer.encode(black_box(&s.text)).unwrap().len())
    });
    for (name, body) in bodies(&s) {
        g.bench_function(format!("query_{name}"), |b| {
            b.iter(|| s.rt.block_on(query(&s.state, black_box(&body))))
        });
    }
    g.finish();
    percentiles(&s);
}

/// p50 / p99 / max of 2,000 sequential requests per shape (criterion reports means).
fn percentiles(s: &Setup) {
    for (name, body) in bodies(s) {
        let mut took: Vec<Duration> = (0..2000)
            .map(|_| {
                let t = Instant::now();
                s.rt.block_on(query(&s.state, &body));
                t.elapsed()
            })
            .collect();
        took.sort();
        println!(
            "query_{name:<9} 8192 tokens: p50 {:>8.1?}  p99 {:>8.1?}  max {:>8.1?}",
            took[took.len() / 2],
            took[took.len() * 99 / 100],
            took[took.len() - 1]
        );
    }
}

criterion_group!(benches, text_benches);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
