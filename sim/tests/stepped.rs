//! The stepped engine model behind the same HTTP API, headers, metrics and KV events as the
//! serial one.

use kvroute_sim::cache::CacheConfig;
use kvroute_sim::engine::{
    EngineConfig, EngineModel, HEADER_CACHED_TOKENS, HEADER_DP_RANK, HEADER_ENGINE,
    HEADER_MODEL_TTFT_US,
};
use serde_json::{json, Value};

use crate::http::serve;

fn config(name: &str, model: EngineModel) -> EngineConfig {
    EngineConfig {
        name: name.into(),
        engine_model: model,
        hash_seed: "same-seed".into(),
        cache: CacheConfig {
            block_size_tokens: 16,
            capacity_blocks: 1000,
        },
        speed: 1000.0,
        journal: true,
        ..EngineConfig::default()
    }
}

fn header_u64(r: &reqwest::Response, name: &str) -> u64 {
    r.headers()[name].to_str().unwrap().parse().unwrap()
}

/// The simulator's own headers of a response, by name.
fn sim_header_names(r: &reqwest::Response) -> Vec<String> {
    let mut v: Vec<String> = r
        .headers()
        .keys()
        .map(|k| k.as_str().to_string())
        .filter(|k| k.starts_with("x-kvroute-sim-") || k == "content-type")
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn a_stepped_engine_serves_requests_with_the_serial_engines_headers_and_events() {
    let (serial, serial_url) = serve(config("eng-1", EngineModel::Serial)).await;
    let (stepped, stepped_url) = serve(config("eng-1", EngineModel::Stepped)).await;
    let c = reqwest::Client::new();
    let first: Vec<u32> = (0..100).collect();
    let second: Vec<u32> = (0..150).collect();
    let mut names = Vec::new();
    for url in [&serial_url, &stepped_url] {
        let mut seen = Vec::new();
        for (ids, stream, cached) in [(&first, false, 0), (&second, true, 96)] {
            let r = c
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": ids, "max_tokens": 3, "stream": stream}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(header_u64(&r, HEADER_CACHED_TOKENS), cached, "{url}");
            assert_eq!(r.headers()[HEADER_ENGINE], "eng-1");
            assert_eq!(header_u64(&r, HEADER_DP_RANK), 0);
            let ttft_us = header_u64(&r, HEADER_MODEL_TTFT_US);
            if url == &stepped_url && !stream {
                // One step of 100 prompt tokens at 20 k tokens/s (above the 4.8 ms floor).
                assert!((4_990..=5_010).contains(&ttft_us), "{ttft_us}");
            }
            seen.push(sim_header_names(&r));
            if stream {
                let text = r.text().await.unwrap();
                let events: Vec<&str> = text.split("\n\n").filter(|s| !s.is_empty()).collect();
                assert_eq!(events.len(), 4, "three tokens then [DONE]: {text}");
                assert_eq!(events[3], "data: [DONE]");
            } else {
                let body: Value = r.json().await.unwrap();
                assert_eq!(body["usage"]["completion_tokens"], 3);
                assert_eq!(
                    body["usage"]["prompt_tokens_details"]["cached_tokens"],
                    cached
                );
            }
        }
        names.push(seen);
    }
    assert_eq!(names[0], names[1], "the same headers");
    // The same requests in the same order cache the same blocks, announced alike.
    assert_eq!(serial.journal(0), stepped.journal(0));
    assert_eq!(serial.cached_hashes(0), stepped.cached_hashes(0));

    // Every request done: the gauges and counters read as the serial engine's.
    for e in [&serial, &stepped] {
        let s = e.stats(0);
        assert_eq!((s.running, s.waiting, s.kv_usage), (0, 0, 0.0));
        assert_eq!(s.requests_finished, 2);
        assert_eq!(s.generation_tokens, 6);
        assert_eq!((s.prompt_tokens, s.prefix_hits_tokens), (250, 96));
    }
    let metrics = c
        .get(format!("{stepped_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "vllm:num_requests_running{engine=\"0\",model_name=\"sim-model\"} 0",
        "vllm:num_requests_waiting{engine=\"0\",model_name=\"sim-model\"} 0",
        "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"sim-model\"} 0.000000",
        "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"sim-model\"} 96",
        "vllm:num_preemptions_total{engine=\"0\",model_name=\"sim-model\"} 0",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
}

#[tokio::test]
async fn a_stepped_engine_under_kv_pressure_preempts_and_still_finishes_every_request() {
    // 60 blocks of 16 tokens; four requests of 10 prompt blocks growing by 12 blocks each.
    let (e, url) = serve(EngineConfig {
        cache: CacheConfig {
            block_size_tokens: 16,
            capacity_blocks: 60,
        },
        // Slow enough (192 steps of at least 0.48 ms) that the four requests are running
        // together: at 1000× one could finish before the next arrived on a busy machine.
        speed: 10.0,
        ..config("eng-p", EngineModel::Stepped)
    })
    .await;
    let c = reqwest::Client::new();
    let mut tasks = Vec::new();
    for k in 0..4u32 {
        let c = c.clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let ids: Vec<u32> = (0..160).map(|i| k * 1000 + i).collect();
            let r = c
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": ids, "max_tokens": 192}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let body: Value = r.json().await.unwrap();
            body["usage"]["completion_tokens"].as_u64().unwrap()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 192);
    }
    let s = e.stats(0);
    assert!(s.preemptions > 0, "{s:?}");
    assert_eq!((s.requests_finished, s.generation_tokens), (4, 4 * 192));
    assert_eq!((s.running, s.waiting), (0, 0));
}
