//! The cost of text requests beside token-id ones (issue 14's target: the extra collector
//! round trip for text at most 1 ms p99 for 8k-token prompts, tokenization included).
//!
//! Through the collector's router (`app(state).oneshot`), no sockets: an index where one
//! worker holds every block of an 8,192-token prompt (block size 16) and `/query` with
//! (a) the token ids, (b) the prompt text, (c) the same text as one chat message; plus
//! `kvroute-text` alone on that text without its piece cache. The prompt is the Mooncake
//! replay's text (`kvroute_text::synth`, 16 blocks of 512 Qwen3 tokens). Repeated bodies hit
//! the tokenizer's piece cache; so the p50 / p99 / max loop after criterion's figures also
//! sends never-seen 8k prompts (cold) and the next turn of a 16-turn conversation (15 turns
//! seen, one new).

mod common;

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, Criterion};
use kvroute::api::RegisterRequest;
use kvroute_collector::config::TokenizerSpec;
use kvroute_collector::decode::decode;
use kvroute_collector::{AppState, Config, Shared};
use kvroute_sim::wire::{encode_events, stored, EventFormat, Extras};
use serde_json::json;

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
    let rt = common::runtime();
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
    common::post(state, "/query", body).await.len()
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

/// `n` request bodies of one shape, each different where the shape says so.
fn varied(shape: &str, n: u64) -> Vec<String> {
    (0..n)
        .map(|i| match shape {
            // A prompt never seen before: every piece tokenized (cold).
            "prompt_cold" => {
                let ids: Vec<u64> = (0..16).map(|b| 1_000_000 + i * 16 + b).collect();
                json!({"model_name": MODEL, "prompt": kvroute_text::synth::trace_text(&ids)})
                    .to_string()
            }
            // The next turn of a conversation: 15 earlier turns of 512 tokens (seen before),
            // one new user turn of 512 tokens.
            _ => {
                let mut messages: Vec<serde_json::Value> = (0..15u64)
                    .map(|t| {
                        let role = if t % 2 == 0 { "user" } else { "assistant" };
                        json!({"role": role, "content": kvroute_text::synth::block_text(2000 + t)})
                    })
                    .collect();
                messages.push(json!({"role": "user", "content": kvroute_text::synth::block_text(3_000_000 + i)}));
                json!({"model_name": MODEL, "messages": messages}).to_string()
            }
        })
        .collect()
}

fn text_benches(c: &mut Criterion) {
    let s = setup();
    let tokenizer = kvroute_text::Tokenizer::from_dir(qwen3_dir()).unwrap();
    let mut g = c.benchmark_group("text_8k");
    g.measurement_time(Duration::from_secs(4));
    g.bench_function("encode_prompt_uncached", |b| {
        b.iter(|| {
            tokenizer
                .encode_uncached(black_box(&s.text), true)
                .unwrap()
                .len()
        })
    });
    for (name, body) in bodies(&s) {
        g.bench_function(format!("query_{name}_repeated"), |b| {
            b.iter(|| s.rt.block_on(query(&s.state, black_box(&body))))
        });
    }
    g.finish();
    percentiles(&s);
}

/// p50 / p99 / max per shape (criterion reports means): 2,000 requests of the repeated
/// shapes, 300 of the varied ones (a cold 8k prompt takes tens of ms).
fn percentiles(s: &Setup) {
    let mut shapes: Vec<(String, Vec<String>)> = bodies(s)
        .into_iter()
        .map(|(name, body)| (format!("{name}_repeated"), vec![body; 2000]))
        .collect();
    shapes.push(("prompt_cold".into(), varied("prompt_cold", 300)));
    shapes.push(("chat_next_turn".into(), varied("chat_next_turn", 300)));
    for (name, bodies) in shapes {
        common::percentiles(&format!("query {name:<18} ~8192 tokens"), &bodies, |body| {
            s.rt.block_on(query(&s.state, body));
        });
    }
}

criterion_group!(benches, text_benches);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
