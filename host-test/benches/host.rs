//! `host::request/<case>`: per-request cost of a fixture, wall time (criterion) and fuel
//! (printed). Dimensions: prompt size (1k, 8k, 32k tokens, as a JSON int array in the body),
//! shared-data index size (10k and 1M keys), half of the prompt's blocks indexed. The module
//! is `fixture_bench` (the filter's request shape) until the real filter's bench replaces it;
//! `probe_headers_only` is the host's floor (a request with one trivial callback).
//!
//! To bench another module, reuse [`Case`]: load, prefill, then `run_case`.

use std::hint::black_box;

use criterion::Criterion;
use kvroute_host_test::{bench, built_wasm, Gateway};

const BLOCK_TOKENS: usize = 16;

/// One benchmark case: a gateway ready to serve, and the request body to send.
pub struct Case {
    pub name: String,
    pub gw: Gateway,
    pub body: Vec<u8>,
}

fn fnv(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// The fixture's chained block hashes of `tokens`.
fn block_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut prev = 0;
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            prev = fnv(prev, &bytes);
            prev
        })
        .collect()
}

fn module(name: &str) -> std::path::PathBuf {
    built_wasm(name).unwrap_or_else(|e| panic!("{e}"))
}

/// `fixture_bench` with `index_keys` shared-data keys, half of the prompt's blocks among them.
pub fn bench_case(prompt_tokens: usize, index_keys: usize) -> Case {
    let mut gw = Gateway::builder(module("fixture_bench"))
        .allow_on_headers_stop_iteration(true)
        .build()
        .expect("fixture_bench loads");
    let tokens: Vec<u32> = (0..prompt_tokens as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 150_000)
        .collect();
    let hashes = block_hashes(&tokens);
    let indexed = hashes.len() / 2;
    let hits = hashes[..indexed]
        .iter()
        .map(|h| (format!("blk:{h:016x}"), b"10.0.0.7:8000".to_vec()));
    let fillers =
        (0..index_keys.saturating_sub(indexed)).map(|i| (format!("blk:f{i:015x}"), vec![0u8; 13]));
    gw.prefill_shared_data(hits.chain(fillers));
    let body =
        serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": tokens})).expect("json");
    let name = format!(
        "fixture_bench_{}k_tokens_{}_keys",
        prompt_tokens / 1024,
        human(index_keys)
    );
    Case { name, gw, body }
}

fn human(n: usize) -> String {
    if n >= 1_000_000 {
        format!("{}m", n / 1_000_000)
    } else {
        format!("{}k", n / 1000)
    }
}

/// Benches one case and prints its fuel per request.
pub fn run_case(c: &mut Criterion, mut case: Case) {
    let body = case.body.clone();
    let run = bench::run(&mut case.gw, 5, |_, r| {
        r.header("content-type", "application/json")
            .body(body.clone())
    })
    .expect("requests complete");
    eprintln!(
        "host::request/{}: fuel/request {}",
        case.name,
        run.fuel_per_request()
    );
    c.bench_function(&format!("host::request/{}", case.name), |b| {
        b.iter(|| {
            let r = case
                .gw
                .request()
                .header("content-type", "application/json")
                .body(body.clone())
                .send();
            black_box(r.state)
        })
    });
}

pub fn request(c: &mut Criterion) {
    let mut floor = Gateway::load(module("fixture_probe"), "").expect("probe loads");
    let run = bench::run(&mut floor, 5, |_, r| r).expect("requests complete");
    eprintln!(
        "host::request/probe_headers_only: fuel/request {}",
        run.fuel_per_request()
    );
    c.bench_function("host::request/probe_headers_only", |b| {
        b.iter(|| black_box(floor.request().send().state))
    });

    for (tokens, keys) in [
        (1024, 10_000),
        (8192, 10_000),
        (32_768, 10_000),
        (8192, 1_000_000),
    ] {
        let case = bench_case(tokens, keys);
        // Sanity: the fixture found the indexed half of the prompt.
        let r = {
            let mut gw = bench_case(tokens, 0).gw;
            let body = case.body.clone();
            gw.request()
                .header("content-type", "application/json")
                .body(body)
                .send()
        };
        assert_eq!(
            r.header("x-match-blocks"),
            Some((tokens / BLOCK_TOKENS / 2).to_string().as_str())
        );
        run_case(c, case);
    }
}
