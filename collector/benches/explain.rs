//! `POST /v1/explain` at the size the issue names: an 8,192-token prompt and 16 engines
//! registered for its model, engine `k` holding the prompt's first `512 × (k + 1)` tokens, so
//! every instance has a different match and a different cost. Through the collector's router
//! (`app(state).oneshot`), no sockets; p50 / p99 / max over 2,000 requests after criterion's
//! mean (the target: p99 ≤ 2 ms).

mod common;

use std::hint::black_box;

use criterion::{criterion_group, Criterion};
use kvroute::api::RegisterRequest;
use kvroute_collector::decode::decode;
use kvroute_collector::{AppState, Config, Shared};
use kvroute_sim::wire::{encode_events, stored, EventFormat, Extras};
use serde_json::json;

const MODEL: &str = "m";
const ENGINES: usize = 16;
const TOKENS: u32 = 8192;

struct Setup {
    rt: tokio::runtime::Runtime,
    state: AppState,
    body: String,
}

fn setup() -> Setup {
    let rt = common::runtime();
    let ids: Vec<u32> = (1..=TOKENS).collect();
    let state = Shared::new(Config::default());
    // Registering starts each worker's subscriber task: inside the runtime.
    let _runtime = rt.enter();
    for k in 0..ENGINES {
        state
            .register(RegisterRequest {
                instance_id: format!("engine-{k}"),
                endpoint: format!("tcp://127.0.0.1:{}", 1 + k),
                replay_endpoint: None,
                model_name: MODEL.into(),
                tenant_id: None,
                block_size: 16,
                dp_rank: None,
                lora_name: None,
                cache_salt: None,
                address: Some(format!("127.0.0.1:{}", 8000 + k)),
            })
            .unwrap();
    }
    let workers: Vec<_> = state.read().workers().map(|w| w.id).collect();
    for (k, id) in workers.into_iter().enumerate() {
        let held = &ids[..512 * (k + 1)];
        let batch = decode(&encode_events(
            EventFormat::Vllm033,
            Extras {
                vllm_group_fields: false,
            },
            1.0,
            &[stored(None, 1, held, 16)],
            Some(0),
        ))
        .unwrap();
        rt.block_on(state.apply_batch(id, 0, batch));
    }
    let body = json!({"model": MODEL, "token_ids": ids}).to_string();
    Setup { rt, state, body }
}

async fn explain(state: &AppState, body: &str) -> usize {
    common::post(state, "/v1/explain", body).await.len()
}

fn explain_benches(c: &mut Criterion) {
    let s = setup();
    // The engine holding the whole prompt wins, and every engine is laid out.
    let answer: serde_json::Value = serde_json::from_slice(&s.rt.block_on(common::post(
        &s.state,
        "/v1/explain",
        &s.body,
    )))
    .unwrap();
    assert_eq!(answer["winner"]["instance_id"], "engine-15", "{answer}");
    assert_eq!(answer["instances"].as_array().map(Vec::len), Some(ENGINES));
    let mut g = c.benchmark_group("explain");
    g.sample_size(50);
    g.bench_function("8192_tokens_16_engines", |b| {
        b.iter(|| black_box(s.rt.block_on(explain(&s.state, &s.body))))
    });
    g.finish();
    common::percentiles(
        &format!("explain 8192 tokens, {ENGINES} engines"),
        &[(); 2000],
        |_| {
            s.rt.block_on(explain(&s.state, &s.body));
        },
    );
}

criterion_group!(benches, explain_benches);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
