//! Replaying a small trace against simulated engines.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvroute_sim::cache::CacheConfig;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::replay::{self, Decision, ReplayConfig, Route, RouteRequest, Target};
use kvroute_sim::trace::{self, TraceRecord};

use crate::http::serve;

fn cfg(name: &str) -> EngineConfig {
    EngineConfig {
        name: name.into(),
        cache: CacheConfig {
            block_size_tokens: 16,
            capacity_blocks: 2000,
        },
        speed: 200.0,
        ..EngineConfig::default()
    }
}

fn small_trace() -> Vec<TraceRecord> {
    trace::parse(
        r#"{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]}
{"timestamp": 500, "input_length": 1300, "output_length": 2, "hash_ids": [1, 2, 4]}
{"timestamp": 1000, "input_length": 600, "output_length": 1, "hash_ids": [9, 10]}
{"timestamp": 1500, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]}"#,
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_by_url_records_ttft_engine_and_cached_tokens() {
    let (_e, url) = serve(cfg("solo")).await;
    let rc = ReplayConfig {
        speed: 200.0,
        ..ReplayConfig::default()
    };
    let results = replay::run(&small_trace(), Target::Url(url), &rc, None).await;
    assert_eq!(results.len(), 4);
    for (i, r) in results.iter().enumerate() {
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.index, i);
        assert_eq!(r.engine.as_deref(), Some("solo"));
        assert!(r.ttft_s.unwrap() <= r.latency_s.unwrap());
    }
    let cached: Vec<usize> = results.iter().map(|r| r.cached_tokens.unwrap()).collect();
    // Requests 0 and 1 share blocks 1, 2 (1024 tokens): the one the engine prefills second
    // finds them (1, in arrival order, unless a loaded machine delays 0's prefill past 1's
    // arrival 2.5 ms later). Request 3 repeats request 0: 1088 of 1100.
    let mut first_two = [cached[0], cached[1]];
    first_two.sort_unstable();
    assert_eq!(first_two, [0, 1024], "{cached:?}");
    assert_eq!(cached[2..], [0, 1088], "{cached:?}");
    assert_eq!(results[1].prompt_tokens, 1300);
    let s = replay::summarize(&results, &["solo".into()]);
    assert_eq!(s.ok, 4);
    let want = (1024.0 + 1088.0) / (1100.0 + 1300.0 + 600.0 + 1100.0);
    assert!((s.hit_rate - want).abs() < 1e-9);
    assert_eq!(s.per_engine["solo"], 4);
}

struct RoundRobin {
    urls: Vec<String>,
    next: AtomicUsize,
    done: AtomicUsize,
}

impl Route for RoundRobin {
    fn route<'a>(&'a self, _req: RouteRequest<'a>) -> replay::BoxFuture<'a, Decision> {
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.urls.len();
        let d = Decision {
            url: self.urls[slot].clone(),
            dp_rank: None,
            slot,
            uncached_tokens: 0,
            ..Decision::default()
        };
        Box::pin(async move { d })
    }
    fn on_done(&self, _d: &Decision) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_through_a_router_spreads_requests_and_reports_per_engine() {
    let (_a, ua) = serve(cfg("a")).await;
    let (_b, ub) = serve(cfg("b")).await;
    let rr = Arc::new(RoundRobin {
        urls: vec![ua, ub],
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
    });
    let rc = ReplayConfig {
        speed: 200.0,
        limit: Some(3),
        ..ReplayConfig::default()
    };
    let results = replay::run(&small_trace(), Target::Routed(rr.clone()), &rc, None).await;
    assert_eq!(results.len(), 3, "--limit");
    let engines: Vec<&str> = results
        .iter()
        .map(|r| r.engine.as_deref().unwrap())
        .collect();
    assert_eq!(engines, vec!["a", "b", "a"]);
    assert_eq!(rr.done.load(Ordering::Relaxed), 3);
    // Request 1 went to b, which had not seen blocks 1, 2.
    assert_eq!(results[1].cached_tokens, Some(0));
    let s = replay::summarize(&results, &["a".into(), "b".into()]);
    assert_eq!(s.per_engine["a"], 2);
    assert_eq!(s.per_engine["b"], 1);
}
