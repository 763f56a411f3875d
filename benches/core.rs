//! Criterion benchmarks of the core: body intake, hashing, index apply rate, longest-match
//! latency.
//! Run with `make bench` (or `cargo bench -p kvroute`).

use criterion::{
    black_box, criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput,
};
use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier, WorkerId};
use kvroute::hash::{self, BASE_SEED};
use kvroute::index::{Index, IndexConfig};
use kvroute::intake::{scan_json, scan_json_bytewise, FieldKind, Found};
use kvroute::scope::{BlockKey, ScopeId};

const BLOCK: usize = 16;

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(salt))
        .collect()
}

/// The body `benches/v8/bench.mjs` and `bench_latency.py` send: ids below 150k, Python's
/// `", "` separators, so native and V8 figures compare.
fn completion_body(n: usize) -> Vec<u8> {
    let mut s: u64 = 12345;
    let ids: Vec<String> = (0..n)
        .map(|_| {
            s = (s * 1_103_515_245 + 12345) % 2_147_483_648;
            (s % 150_000).to_string()
        })
        .collect();
    format!(
        "{{\"model\": \"m\", \"prompt\": [{}], \"max_tokens\": 1}}",
        ids.join(", ")
    )
    .into_bytes()
}

fn intake(c: &mut Criterion) {
    const FIELDS: [(&str, FieldKind); 4] = [
        ("prompt", FieldKind::TokensOrText),
        ("model", FieldKind::Str),
        ("max_tokens", FieldKind::Uint),
        ("messages", FieldKind::Raw),
    ];
    let mut g = c.benchmark_group("intake/scan_json");
    let mut tokens = Vec::new();
    let mut found = [Found::Absent; 4];
    for n in [1024usize, 8192] {
        let body = completion_body(n);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::new("words", n), &body, |b, body| {
            b.iter(|| {
                scan_json(black_box(body), &FIELDS, &mut tokens, &mut found, 1 << 20).unwrap()
            })
        });
        g.bench_with_input(BenchmarkId::new("bytewise", n), &body, |b, body| {
            b.iter(|| {
                scan_json_bytewise(black_box(body), &FIELDS, &mut tokens, &mut found, 1 << 20)
                    .unwrap()
            })
        });
    }
    g.finish();
}

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash/sequence_hashes");
    let mut out = Vec::new();
    for n in [1024usize, 8192, 32768] {
        let t = tokens(n, 1);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &t, |b, t| {
            b.iter(|| hash::sequence_hashes_into(black_box(t), BLOCK, BASE_SEED, &mut out).unwrap())
        });
    }
    g.finish();
}

/// Chains of 32 blocks, each a BlockStored event, as a worker would publish them.
fn store_events(chains: usize, salt: u32) -> Vec<KvEvent> {
    (0..chains)
        .map(|c| {
            let t = tokens(32 * BLOCK, salt.wrapping_add(c as u32 * 7919));
            KvEvent::BlockStored {
                parent: None,
                blocks: t
                    .chunks_exact(BLOCK)
                    .enumerate()
                    .map(|(i, b)| StoredBlock {
                        hash: EngineHash(((c as u64) << 8) | i as u64),
                        tokens: b.to_vec(),
                        block_hash: None,
                    })
                    .collect(),
                tier: Tier::Gpu,
                lora_name: None,
                cache_salt: None,
            }
        })
        .collect()
}

fn apply(c: &mut Criterion) {
    let mut g = c.benchmark_group("index/apply");
    let events = store_events(2048, 3);
    let blocks = 2048 * 32;
    g.throughput(Throughput::Elements(blocks as u64));
    g.bench_function("store_65536_blocks", |b| {
        b.iter_batched(
            || {
                let mut index = Index::new(IndexConfig::default());
                index.add_worker(WorkerId(0), "default", "m", BLOCK as u32);
                (index, Vec::with_capacity(blocks))
            },
            |(mut index, mut changes)| {
                for e in &events {
                    index.apply(WorkerId(0), e, &mut changes);
                }
                (index, changes)
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// `workers` workers hold overlapping prefixes of one 512-block prompt (worker w holds the
/// first 512·(w+1)/workers blocks), beside 64 unrelated chains each.
fn lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("index/lookup_512_blocks");
    let prompt = tokens(512 * BLOCK, 11);
    let seqs = hash::sequence_hashes(&prompt, BLOCK, BASE_SEED).unwrap();
    let scope = ScopeId::of("default", "m", None, None);
    let keys: Vec<BlockKey> = seqs.iter().map(|&s| scope.key(s)).collect();
    for workers in [8usize, 64, 1024] {
        let mut index = Index::new(IndexConfig::default());
        let mut changes = Vec::new();
        for w in 0..workers {
            let worker = WorkerId(w as u32);
            index.add_worker(worker, "default", "m", BLOCK as u32);
            let depth = 512 * (w + 1) / workers;
            let blocks = prompt[..depth * BLOCK]
                .chunks_exact(BLOCK)
                .enumerate()
                .map(|(i, b)| StoredBlock {
                    hash: EngineHash(i as u64),
                    tokens: b.to_vec(),
                    block_hash: None,
                })
                .collect();
            let event = KvEvent::BlockStored {
                parent: None,
                blocks,
                tier: Tier::Gpu,
                lora_name: None,
                cache_salt: None,
            };
            index.apply(worker, &event, &mut changes);
            for e in store_events(64, 1000 + w as u32) {
                index.apply(worker, &e, &mut changes);
            }
            changes.clear();
        }
        let mut stats = kvroute::lookup::WalkStats::default();
        let found = kvroute::lookup::longest_matches(&index, &keys, &mut stats);
        assert_eq!(
            found.len(),
            (0..workers).filter(|w| 512 * (w + 1) / workers > 0).count()
        );
        eprintln!(
            "lookup with {workers} workers: {} holder reads for {} blocks",
            stats.reads,
            keys.len()
        );
        g.bench_with_input(BenchmarkId::from_parameter(workers), &keys, |b, keys| {
            b.iter(|| black_box(index.lookup(black_box(keys))))
        });
    }
    g.finish();
}

criterion_group!(benches, intake, hashing, apply, lookup);
criterion_main!(benches);
