//! `POST /v1/explain` at the size the issue names: an 8,192-token prompt and 16 engines
//! registered for its model, engine `k` holding the prompt's first `512 × (k + 1)` tokens, so
//! every instance has a different match and a different cost. Through the collector's router
//! (`app(state).oneshot`), no sockets; p50 / p99 / max over 2,000 requests after criterion's
//! mean (the target: p99 ≤ 2 ms).

use std::hint::black_box;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use criterion::{criterion_group, Criterion};
use http_body_util::BodyExt;
use kvroute::api::RegisterRequest;
use kvroute_collector::decode::decode;
use kvroute_collector::{app, AppState, Config, Shared};
use kvroute_sim::wire::{encode_events, stored, EventFormat, Extras};
use serde_json::json;
use tower::ServiceExt;

const MODEL: &str = "m";
const ENGINES: usize = 16;
const TOKENS: u32 = 8192;

struct Setup {
    rt: tokio::runtime::Runtime,
    state: AppState,
    body: String,
}

fn setup() -> Setup {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
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
    let req = Request::post("/v1/explain")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let res = app(state.clone()).oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    res.into_body().collect().await.unwrap().to_bytes().len()
}

fn explain_benches(c: &mut Criterion) {
    let s = setup();
    // The engine holding the whole prompt wins, and every engine is laid out.
    let answer: serde_json::Value = s.rt.block_on(async {
        let req = Request::post("/v1/explain")
            .header("content-type", "application/json")
            .body(Body::from(s.body.clone()))
            .unwrap();
        let res = app(s.state.clone()).oneshot(req).await.unwrap();
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    });
    assert_eq!(answer["winner"]["instance_id"], "engine-15", "{answer}");
    assert_eq!(answer["instances"].as_array().map(Vec::len), Some(ENGINES));
    let mut g = c.benchmark_group("explain");
    g.sample_size(50);
    g.bench_function("8192_tokens_16_engines", |b| {
        b.iter(|| black_box(s.rt.block_on(explain(&s.state, &s.body))))
    });
    g.finish();
    let mut took: Vec<Duration> = (0..2000)
        .map(|_| {
            let t = Instant::now();
            s.rt.block_on(explain(&s.state, &s.body));
            t.elapsed()
        })
        .collect();
    took.sort();
    println!(
        "explain 8192 tokens, {ENGINES} engines: p50 {:>8.1?}  p99 {:>8.1?}  max {:>8.1?}",
        took[took.len() / 2],
        took[took.len() * 99 / 100],
        took[took.len() - 1]
    );
}

criterion_group!(benches, explain_benches);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
