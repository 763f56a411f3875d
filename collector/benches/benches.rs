//! Criterion micro-benchmarks of the collector's hot paths (the system benchmarks over real
//! sockets are `kvroute-bench collector`, see BENCH.md).
//!
//! Dimensions: a vLLM 0.33 batch of 16 chains × 64 blocks of 16 tokens (1,024 blocks);
//! an index of 8 workers × 12,500 blocks; an 8,192-token query whose deepest holder matches
//! all 512 blocks.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute::api::RegisterRequest;
use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};
use kvroute_collector::decode::decode;
use kvroute_collector::hub::{Hub, HubConfig, Registered};
use kvroute_sim::wire::{encode_events, EventFormat, Extras};

const BS: usize = 16;

/// vLLM 0.33 batches with only the mandatory fields, as the published figures were made.
fn encode_batch(events: &[KvEvent]) -> Vec<u8> {
    let plain = Extras {
        vllm_group_fields: false,
    };
    encode_events(EventFormat::Vllm033, plain, 1.0, events, Some(0))
}

fn chain(id: u64, tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored {
        parent: None,
        blocks: tokens
            .chunks(BS)
            .enumerate()
            .map(|(i, t)| StoredBlock {
                hash: EngineHash(id << 20 | i as u64),
                tokens: t.to_vec(),
                block_hash: None,
            })
            .collect(),
        tier: Tier::Gpu,
        lora_name: None,
        cache_salt: None,
    }
}

fn batch(first_chain: u64) -> Vec<u8> {
    let events: Vec<KvEvent> = (0..16)
        .map(|c| {
            let mut t: Vec<u32> = (0..64 * BS as u32).map(|i| i % 100).collect();
            t[0] = (first_chain + c) as u32;
            chain(first_chain + c, &t)
        })
        .collect();
    encode_batch(&events)
}

fn hub() -> (Hub, Vec<kvroute::event::WorkerId>) {
    let mut hub = Hub::new(
        HubConfig {
            max_blocks_per_worker: 1 << 24,
            max_pages_per_worker: 1 << 20,
            default_serving_port: None,
            max_query_tokens: 1 << 20,
            feed_log_entries: 1 << 16,
            max_feed_bytes: 1 << 20,
            limits: kvroute_collector::hub::Limits::default(),
        },
        1,
    );
    let ids = (0..8)
        .map(|i| {
            let r = RegisterRequest {
                instance_id: format!("w{i}"),
                endpoint: "tcp://127.0.0.1:1".into(),
                replay_endpoint: None,
                model_name: "m".into(),
                tenant_id: None,
                block_size: BS as u32,
                dp_rank: None,
                lora_name: None,
                cache_salt: None,
                address: Some("127.0.0.1:1".into()),
            };
            match hub.register(r).unwrap() {
                Registered::New(id) | Registered::Same(id) => id,
            }
        })
        .collect();
    (hub, ids)
}

fn benches(c: &mut Criterion) {
    let payload = batch(1);
    let mut g = c.benchmark_group("decode");
    g.throughput(Throughput::Elements(1024));
    g.bench_function("decode/vllm_map_1024_blocks", |b| {
        b.iter(|| black_box(decode(black_box(&payload)).unwrap()))
    });
    g.finish();

    let mut g = c.benchmark_group("hub");
    g.throughput(Throughput::Elements(1024));
    g.bench_function("hub::apply_batch/stored_1024_blocks", |b| {
        let (mut h, ids) = hub();
        let mut n = 0u64;
        b.iter(|| {
            let batch = decode(&payload).unwrap();
            // Alternate store and clear so the index stays small.
            h.apply_batch(ids[0], n, batch);
            n += 1;
            h.clear_blocks(ids[0]);
        })
    });
    g.finish();

    let body = serde_json::json!({"token_ids": (0..8192u32).map(|i| i * 7 % 50_000).collect::<Vec<_>>(), "model_name": "m"}).to_string();
    let mut g = c.benchmark_group("api");
    g.bench_function("fastjson::parse_query/8192_tokens", |b| {
        b.iter(|| {
            black_box(kvroute_collector::fastjson::parse_query(black_box(body.as_bytes())).unwrap())
        })
    });
    g.bench_function("serde_json::from_slice/8192_tokens", |b| {
        b.iter(|| {
            black_box(
                serde_json::from_slice::<kvroute::api::QueryRequest>(black_box(body.as_bytes()))
                    .unwrap(),
            )
        })
    });
    g.finish();

    let (mut h, ids) = hub();
    let prompt: Vec<u32> = (0..512 * BS as u32).map(|i| i * 7 % 50_000).collect();
    for (w, &id) in ids.iter().enumerate() {
        let depth = (w + 1) * 64;
        let ev = chain(1 << 30, &prompt[..depth * BS]);
        let b = decode(&encode_batch(&[ev])).unwrap();
        h.apply_batch(id, 0, b);
        for k in 0..((12_500 - depth) / 1024) {
            let b = decode(&batch(w as u64 * 100_000 + k as u64 * 16 + 2)).unwrap();
            h.apply_batch(id, k as u64 + 1, b);
        }
    }
    let mut g = c.benchmark_group("hub");
    g.bench_function("hub::query_tokens/8192_tokens_100k_index", |b| {
        b.iter(|| {
            black_box(
                h.query_tokens(black_box(&prompt), "m", None, None, None)
                    .unwrap(),
            )
        })
    });
    g.finish();
}

criterion_group! {
    name = suites;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(suites);
