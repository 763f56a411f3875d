//! The engine's HTTP API on a real socket.

use kvroute_sim::cache::CacheConfig;
use kvroute_sim::engine::{Engine, EngineConfig, HEADER_CACHED_TOKENS, HEADER_ENGINE};
use serde_json::{json, Value};

pub async fn serve(cfg: EngineConfig) -> (Engine, String) {
    let e = Engine::start(cfg).await.expect("engine");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = e.app();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (e, url)
}

fn small(name: &str) -> EngineConfig {
    EngineConfig {
        name: name.into(),
        cache: CacheConfig {
            block_size_tokens: 16,
            capacity_blocks: 1000,
        },
        speed: 1000.0,
        ..EngineConfig::default()
    }
}

fn cached(resp: &reqwest::Response) -> u64 {
    resp.headers()[HEADER_CACHED_TOKENS]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn completions_report_prefix_hits_for_ids_and_text_alike() {
    let (_e, url) = serve(small("eng-a")).await;
    let c = reqwest::Client::new();
    let ids: Vec<u32> = (0..100).collect();
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "sim-model", "prompt": ids, "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(cached(&r), 0);
    assert_eq!(r.headers()[HEADER_ENGINE], "eng-a");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], 100);
    assert_eq!(body["usage"]["completion_tokens"], 3);
    // The same tokens as text: 96 tokens (6 full blocks) come from the cache.
    let text = kvroute_sim::tokenizer::decode(&ids);
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": text, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(cached(&r), 96);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
}

#[tokio::test]
async fn streaming_sends_one_event_per_token_then_done() {
    let (_e, url) = serve(small("eng-s")).await;
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 4, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let model_ttft_us: u64 = r.headers()[kvroute_sim::engine::HEADER_MODEL_TTFT_US]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        model_ttft_us >= 15_000,
        "at least the 15 ms first-token overhead"
    );
    assert_eq!(cached(&r), 0);
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|s| !s.is_empty()).collect();
    assert_eq!(events.len(), 5, "{text}");
    assert_eq!(events[4], "data: [DONE]");
    let last: Value = serde_json::from_str(events[3].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["system_fingerprint"], "eng-s");
}

#[tokio::test]
async fn generate_tokenize_models_and_metrics() {
    let (_e, url) = serve(small("eng-g")).await;
    let c = reqwest::Client::new();
    let ids: Vec<u32> = (0..40).collect();
    for expect in [0, 32] {
        let r = c
            .post(format!("{url}/generate"))
            .json(&json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}))
            .send()
            .await
            .unwrap();
        assert_eq!(cached(&r), expect);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["meta_info"]["cached_tokens"], expect);
        assert_eq!(v["output_ids"].as_array().unwrap().len(), 2);
    }
    let v: Value = c
        .post(format!("{url}/tokenize"))
        .json(&json!({"prompt": "t5 t6 t7"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["tokens"], json!([5, 6, 7]));
    assert_eq!(v["count"], 3);
    let v: Value = c
        .get(format!("{url}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["data"][0]["id"], "sim-model");
    assert_eq!(
        c.get(format!("{url}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let m = c
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"sim-model\"} 80"),
        "{m}"
    );
    assert!(
        m.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"sim-model\"} 32"),
        "{m}"
    );
    assert!(m.contains("vllm:num_requests_running{engine=\"0\",model_name=\"sim-model\"} 0"));
    assert!(m.contains("vllm:num_requests_waiting"));
    assert!(m.contains("vllm:kv_cache_usage_perc"));
    let bad = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
}

#[tokio::test]
async fn requests_beyond_the_concurrency_limit_wait_their_turn() {
    let (e, _url) = serve(EngineConfig {
        max_running: 1,
        speed: 1.0,
        ..small("eng-q")
    })
    .await;
    let first = e.submit(vec![1; 20], 1, None).await.unwrap();
    let e2 = e.clone();
    let waiting = tokio::spawn(async move {
        e2.submit(vec![2; 20], 1, None)
            .await
            .map(|r| r.cached_tokens)
    });
    // Wait (bounded) until the second request is queued, then check it is not admitted.
    for _ in 0..1000 {
        if e.stats(0).waiting == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(e.stats(0).waiting, 1);
    assert_eq!(e.stats(0).running, 1);
    drop(first);
    assert_eq!(waiting.await.unwrap().unwrap(), 0);
    assert_eq!(e.stats(0).waiting, 0);
}

/// `/metrics` shows the engine's real queue, in vLLM's names (`engine` label) or, for an
/// engine publishing SGLang events, SGLang's (`dp_rank` label); the collector's scraper reads
/// both.
#[tokio::test]
async fn metrics_show_the_queue_in_the_engine_format() {
    for format in [
        kvroute_sim::wire::EventFormat::Vllm033,
        kvroute_sim::wire::EventFormat::Sglang,
    ] {
        let (e, url) = serve(EngineConfig {
            max_running: 1,
            speed: 1.0,
            event_format: format,
            ..small("eng-m")
        })
        .await;
        let first = e.submit(vec![1; 20], 1, None).await.unwrap();
        let mut queued = Vec::new();
        for i in 0..3u32 {
            let e2 = e.clone();
            queued.push(tokio::spawn(async move {
                e2.submit(vec![10 + i; 20], 1, None).await.is_ok()
            }));
        }
        for _ in 0..10_000 {
            if e.stats(0).waiting == 3 {
                break;
            }
            tokio::task::yield_now().await;
        }
        let page = reqwest::get(format!("{url}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let (waiting, running) = if format == kvroute_sim::wire::EventFormat::Sglang {
            assert!(!page.contains("vllm:num_requests_waiting"), "{page}");
            (
                "sglang:num_queue_reqs{dp_rank=\"0\",model_name=\"sim-model\"} 3",
                "sglang:num_running_reqs{dp_rank=\"0\",model_name=\"sim-model\"} 1",
            )
        } else {
            (
                "vllm:num_requests_waiting{engine=\"0\",model_name=\"sim-model\"} 3",
                "vllm:num_requests_running{engine=\"0\",model_name=\"sim-model\"} 1",
            )
        };
        assert!(page.contains(waiting), "{page}");
        assert!(page.contains(running), "{page}");
        // The reuse figures the collector's truth check reads, and the vLLM cache config.
        if format == kvroute_sim::wire::EventFormat::Sglang {
            assert!(
                page.contains(
                    "sglang:cache_hit_rate{dp_rank=\"0\",model_name=\"sim-model\"} 0.000000"
                ),
                "{page}"
            );
            assert!(!page.contains("vllm:cache_config_info"), "{page}");
        } else {
            assert!(
                page.contains("vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"0\""),
                "{page}"
            );
            assert!(!page.contains("sglang:cache_hit_rate"), "{page}");
        }
        drop(first);
        for q in queued {
            assert!(q.await.unwrap());
        }
    }
}
