//! Engines that behave as attackers (issue 11): floods of LoRA names and dp ranks, a huge
//! batch, broken state files. Each must cost only what its caps allow, be counted, and go
//! away with its registration; the collector keeps answering throughout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use kvroute::api::{RegisterRequest, UnregisterRequest};
use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};
use kvroute_collector::decode::{Batch, DecodeStats};
use kvroute_collector::hub::{Hub, HubConfig, Limits, Registered, StateFile};
use kvroute_collector::{app, AppState, Config, Shared};
use kvroute_sim::publisher::Publisher;
use kvroute_sim::wire::{self, stored, EventFormat, ReplayShape, WireEvent};
use serde_json::Value;
use tower::ServiceExt;

use crate::common::*;

const M: &str = "llama";

fn with_lora(mut ev: KvEvent, lora: &str) -> KvEvent {
    if let KvEvent::BlockStored { lora_name, .. } = &mut ev {
        *lora_name = Some(lora.into());
    }
    ev
}

fn unregister(instance: &str, model: &str) -> UnregisterRequest {
    UnregisterRequest {
        instance_id: instance.into(),
        model_name: model.into(),
        tenant_id: None,
        dp_rank: None,
    }
}

/// Waits until the `limited` counter of `reason` reaches `want` (the hub's status counts a
/// batch under the lock, the caller counts its report into the metrics just after), then
/// returns what it reads.
async fn limited_reaches(state: &AppState, reason: &str, want: u64) -> u64 {
    let until = Instant::now() + DEADLINE;
    loop {
        let n = limited(state, reason);
        if n >= want || Instant::now() > until {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn limited(state: &AppState, reason: &str) -> u64 {
    let text = state.metrics.encode();
    let key = format!("kvroute_limited_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |n| n.trim().parse().unwrap())
}

async fn get(state: &AppState, uri: &str) -> (StatusCode, String) {
    let req = Request::builder()
        .method(Method::GET)
        .uri(uri)
        .body(Body::empty())
        .unwrap();
    let res = app(state.clone()).oneshot(req).await.unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_flood_is_capped_counted_and_leaves_with_unregister() {
    let state = Shared::new(Config {
        limits: Limits {
            aliases_per_worker: 8,
            ..Limits::default()
        },
        ..config()
    });
    let mut good = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    let mut bad = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    state
        .register(registration("good", &good, M, None, 4))
        .unwrap();
    state
        .register(registration("bad", &bad, M, None, 4))
        .unwrap();
    let t = tokens(1, 16);
    good.publish_events(&[stored(None, 10, &t, 4)]);
    eventually(&state, Some(&mut good), |h| {
        longest(h, &t, M, None, "good") == 16
    })
    .await;
    // 500 stores with no blocks, each naming a fresh LoRA: only names, no blocks to cap.
    let flood: Vec<KvEvent> = (0..500)
        .map(|i| with_lora(stored(None, 1000 + i, &[], 4), &format!("lora-{i}")))
        .collect();
    for chunk in flood.chunks(100) {
        bad.publish_events(chunk);
    }
    eventually(&state, Some(&mut bad), |h| {
        h.worker_views()
            .iter()
            .any(|w| w.instance_id == "bad" && w.status.events == 500)
    })
    .await;
    assert_eq!(
        state.read().alias_count(),
        8,
        "the per-registration cap holds"
    );
    assert_eq!(
        limited_reaches(&state, "aliases_per_worker", 492).await,
        492
    );
    assert_eq!(longest(&state.read(), &t, M, None, "good"), 16);
    state.unregister(&unregister("bad", M)).unwrap();
    assert_eq!(
        state.read().alias_count(),
        0,
        "learned aliases leave with their engine"
    );
    assert_eq!(longest(&state.read(), &t, M, None, "good"), 16);
    // Its metric series go too: registrations that come and go do not grow the registry.
    let (_, metrics) = get(&state, "/metrics").await;
    assert!(!metrics.contains("instance=\"bad\""), "{metrics}");
    assert!(metrics.contains("instance=\"good\""), "{metrics}");
    state.stop_subscribers();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_never_shadows_a_registered_model_nor_another_models_alias() {
    let state = Shared::new(config());
    let mut bad = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    let victim = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    let other = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    state
        .register(registration("bad", &bad, M, None, 4))
        .unwrap();
    let mut reg = registration("other", &other, "mistral", None, 4);
    reg.lora_name = Some("taken".into());
    state.register(reg).unwrap();
    let t = tokens(1, 8);
    // Before "victim" registers, the name is free: the bad engine's LoRA takes it.
    bad.publish_events(&[with_lora(stored(None, 10, &t, 4), "victim")]);
    eventually(&state, Some(&mut bad), |h| {
        h.alias("default", "victim").is_some()
    })
    .await;
    state
        .register(registration("v", &victim, "victim", None, 4))
        .unwrap();
    assert_eq!(
        state.read().alias("default", "victim"),
        None,
        "the model wins"
    );
    let r = query(&state.read(), &t, "victim", None);
    assert!(
        r.instances.is_empty(),
        "/query model=victim is victim's own"
    );
    // Now the name is a model's, and "taken" is another model's alias: both refused.
    bad.publish_events(&[
        with_lora(stored(None, 20, &t, 4), "victim"),
        with_lora(stored(None, 30, &t, 4), "taken"),
    ]);
    eventually(&state, Some(&mut bad), |_| {
        limited(&state, "alias_is_model") == 1 && limited(&state, "alias_taken") == 1
    })
    .await;
    assert_eq!(
        state.read().alias("default", "taken"),
        Some(("mistral", Some("taken")))
    );
    state.stop_subscribers();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dp_rank_flood_is_capped_shares_one_budget_and_leaves_register_room() {
    let state = Shared::new(Config {
        max_blocks_per_worker: 40,
        limits: Limits {
            dp_ranks_per_worker: 4,
            ..Limits::default()
        },
        ..config()
    });
    let mut bad = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    state
        .register(registration("bad", &bad, M, None, 4))
        .unwrap();
    let t = tokens(1, 80);
    for dp in 1..=50u32 {
        publish_dp(&bad, dp, &[stored(None, dp as u64 * 1000, &t, 4)]);
    }
    eventually(&state, Some(&mut bad), |h| {
        h.worker(kvroute::event::WorkerId(0))
            .is_some_and(|w| w.status.batches >= 50)
    })
    .await;
    {
        let hub = state.read();
        assert_eq!(hub.workers().count(), 5, "itself and 4 siblings");
        let blocks: u64 = hub.worker_views().iter().map(|w| w.blocks).sum();
        assert_eq!(blocks, 40, "one budget for the registration's ranks");
    }
    assert_eq!(limited_reaches(&state, "dp_ranks_per_worker", 46).await, 46);
    assert!(limited_reaches(&state, "blocks_per_registration", 1).await > 0);
    // The slots are not gone: registrations still succeed.
    for i in 0..20 {
        let r = RegisterRequest {
            instance_id: format!("10.1.0.{i}:8000"),
            ..registration("x", &bad, "m2", None, 4)
        };
        assert!(matches!(state.write().register(r), Ok(Registered::New(_))));
    }
    state.unregister(&unregister("bad", M)).unwrap();
    assert!(state.read().workers().all(|w| w.reg.model_name == "m2"));
    state.stop_subscribers();
}

#[test]
fn dp_rank_siblings_in_all_are_capped_below_the_slot_table() {
    let mut hub = Hub::new(
        HubConfig {
            max_blocks_per_worker: 100,
            max_pages_per_worker: 100,
            default_serving_port: Some(8000),
            max_query_tokens: 100,
            feed_log_entries: 100,
            max_feed_bytes: 1 << 20,
            limits: Limits {
                dp_ranks_per_worker: 10,
                dp_workers: 15,
                ..Limits::default()
            },
        },
        1,
    );
    let mut refused = 0;
    for e in 0..3u32 {
        let reg = RegisterRequest {
            instance_id: format!("e{e}"),
            endpoint: format!("tcp://10.0.0.{e}:5557"),
            replay_endpoint: None,
            model_name: M.into(),
            tenant_id: None,
            block_size: 4,
            dp_rank: None,
            lora_name: None,
            cache_salt: None,
            address: None,
        };
        let Ok(Registered::New(id)) = hub.register(reg) else {
            panic!("registers")
        };
        for dp in 1..=10 {
            let batch = Batch {
                ts: 0.0,
                dp_rank: Some(dp),
                events: vec![],
                stats: DecodeStats::default(),
            };
            let r = hub.apply_batch(id, dp as u64, batch);
            refused += r.limits.iter().map(|(_, n)| n).sum::<u64>();
        }
    }
    assert_eq!(hub.workers().filter(|w| w.source.is_some()).count(), 15);
    assert_eq!(refused, 15);
}

/// One engine batch of `n` chained blocks of 4 tokens.
fn huge_batch(n: usize, first_hash: u64) -> Batch {
    let blocks = (0..n)
        .map(|i| StoredBlock {
            hash: EngineHash(first_hash + i as u64),
            tokens: vec![i as u32; 4],
            block_hash: None,
        })
        .collect();
    Batch {
        ts: 0.0,
        dp_rank: None,
        events: vec![KvEvent::BlockStored {
            parent: None,
            blocks,
            tier: Tier::Gpu,
            lora_name: None,
            cache_salt: None,
        }],
        stats: DecodeStats::default(),
    }
}

/// Applies a batch of `blocks` blocks while another thread queries without pause; returns
/// the query latencies, sorted, and the number of slices.
async fn queries_during_a_huge_batch(blocks: usize, slice: usize) -> (Vec<Duration>, u32) {
    let state = Shared::new(Config {
        max_blocks_per_worker: blocks + 100,
        limits: Limits {
            slice_blocks: slice,
            ..Limits::default()
        },
        ingest_lag_degraded: Duration::ZERO,
        ..config()
    });
    let reg = |i: &str, ep: &str| RegisterRequest {
        instance_id: i.into(),
        endpoint: ep.into(),
        replay_endpoint: None,
        model_name: M.into(),
        tenant_id: None,
        block_size: 4,
        dp_rank: None,
        lora_name: None,
        cache_salt: None,
        address: Some("10.0.0.9:8000".into()),
    };
    let Ok(Registered::New(good)) = state.write().register(reg("good", "tcp://10.0.0.1:1")) else {
        panic!()
    };
    let Ok(Registered::New(big)) = state.write().register(reg("big", "tcp://10.0.0.2:1")) else {
        panic!()
    };
    let t = tokens(1, 64);
    state
        .apply_batch(
            good,
            0,
            Batch {
                ts: 0.0,
                dp_rank: None,
                events: vec![stored(None, 1, &t, 4)],
                stats: DecodeStats::default(),
            },
        )
        .await;
    let done = Arc::new(AtomicBool::new(false));
    let querier = {
        let (state, done, t) = (state.clone(), done.clone(), t.clone());
        std::thread::spawn(move || {
            let mut lat = Vec::new();
            let mut degraded = false;
            while !done.load(Ordering::Relaxed) {
                let at = Instant::now();
                let n = longest(&state.read(), &t, M, None, "good");
                lat.push(at.elapsed());
                assert_eq!(n, 64, "the good engine's match holds throughout");
                degraded |= !state.problems().is_empty();
                std::thread::sleep(Duration::from_micros(200));
            }
            (lat, degraded)
        })
    };
    let batch = huge_batch(blocks, 1 << 40);
    let report = tokio::spawn({
        let state = state.clone();
        async move { state.apply_batch(big, 0, batch).await }
    })
    .await
    .unwrap();
    done.store(true, Ordering::Relaxed);
    let (mut lat, degraded) = querier.join().unwrap();
    assert!(degraded, "/health said degraded while the batch applied");
    assert!(state.problems().is_empty(), "and ok once it is through");
    assert_eq!(report.apply.stored, blocks as u64);
    assert_eq!(state.read().index.worker_blocks(big), blocks);
    lat.sort();
    (lat, report.slices)
}

/// Functional only: the latency figures (3.5M blocks, release build) are
/// `kvroute-bench ingest-stall`'s, a benchmark, not a timed test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_batch_goes_in_slices_while_queries_keep_answering() {
    let (lat, slices) = queries_during_a_huge_batch(200_000, 8192).await;
    assert!(slices >= 25, "{slices} slices");
    assert!(lat.len() > 10, "queries ran during the batch");
    let max = *lat.last().unwrap();
    // Unoptimized build: a slice, not the batch, is the most a query waits.
    assert!(max < Duration::from_secs(2), "a query waited {max:?}");
}

/// A valid state: one registered worker with a block, as `serde_json::Value` to damage.
fn good_state() -> Value {
    let mut hub = Hub::new(
        HubConfig {
            max_blocks_per_worker: 100,
            max_pages_per_worker: 100,
            default_serving_port: Some(8000),
            max_query_tokens: 100,
            feed_log_entries: 100,
            max_feed_bytes: 1 << 20,
            limits: Limits::default(),
        },
        1,
    );
    let reg = RegisterRequest {
        instance_id: "a".into(),
        endpoint: "tcp://10.0.0.1:5557".into(),
        replay_endpoint: None,
        model_name: M.into(),
        tenant_id: None,
        block_size: 4,
        dp_rank: None,
        lora_name: Some("ad".into()),
        cache_salt: None,
        address: None,
    };
    let Ok(Registered::New(id)) = hub.register(reg) else {
        panic!()
    };
    hub.apply_batch(
        id,
        3,
        Batch {
            ts: 0.0,
            dp_rank: None,
            events: vec![stored(None, 1, &tokens(1, 8), 4)],
            stats: DecodeStats::default(),
        },
    );
    let file: StateFile = hub.export();
    serde_json::to_value(file).unwrap()
}

fn rejected_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("state.json.rejected-"))
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_state_files_are_moved_aside_uniquely_and_health_says_so() {
    let good = good_state();
    let damaged: Vec<(&str, Vec<u8>)> = {
        let mut cases: Vec<(&str, Value)> = Vec::new();
        let mut v = good.clone();
        v["version"] = 7.into();
        cases.push(("unknown version", v));
        let mut v = good.clone();
        v["workers"][0]["reg"]["block_size"] = 0.into();
        cases.push(("block_size 0", v));
        let mut v = good.clone();
        let w = v["workers"][0].clone();
        v["workers"].as_array_mut().unwrap().push(w);
        cases.push(("duplicate worker", v));
        let mut v = good.clone();
        v["workers"][0]["id"] = 5000.into();
        cases.push(("id out of range", v));
        let mut v = good.clone();
        v["index"]["workers"][0]["worker"] = 9.into();
        cases.push(("index of an unknown worker", v));
        let mut v = good.clone();
        v["workers"][0]["source"] = 3.into();
        cases.push(("source that is no worker", v));
        let mut v = good.clone();
        v["aliases"][0]["model"] = "nobody".into();
        cases.push(("alias of an unknown model", v));
        let mut out: Vec<(&str, Vec<u8>)> = cases
            .into_iter()
            .map(|(n, v)| (n, serde_json::to_vec(&v).unwrap()))
            .collect();
        out.push(("not json", b"\x00garbage".to_vec()));
        out.push(("not json again", b"{\"version\":".to_vec()));
        out
    };
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config {
        state_dir: Some(dir.path().to_owned()),
        ..config()
    };
    // The undamaged file loads: the damage, not the test's file, is what is refused.
    std::fs::write(
        dir.path().join("state.json"),
        serde_json::to_vec(&good).unwrap(),
    )
    .unwrap();
    let state = kvroute_collector::start(cfg.clone()).unwrap();
    assert_eq!(state.read().workers().count(), 1);
    assert!(state.problems().is_empty());
    state.stop_subscribers();
    std::fs::remove_file(dir.path().join("state.json")).unwrap();

    for (i, (name, bytes)) in damaged.iter().enumerate() {
        std::fs::write(dir.path().join("state.json"), bytes).unwrap();
        let state = kvroute_collector::start(cfg.clone()).unwrap();
        assert_eq!(
            state.read().workers().count(),
            0,
            "{name}: started without it"
        );
        let rejected = rejected_files(dir.path());
        assert_eq!(
            rejected.len(),
            i + 1,
            "{name}: a new file each time, none overwritten"
        );
        assert!(
            rejected.iter().any(|p| std::fs::read(p).unwrap() == *bytes),
            "{name}: the original is kept whole"
        );
        assert!(!dir.path().join("state.json").exists(), "{name}");
        let (status, body) = get(&state, "/health").await;
        assert_eq!(status, StatusCode::OK);
        let h: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(h["status"], "degraded", "{name}: {body}");
        assert!(
            h["reasons"][0].as_str().unwrap().contains("moved aside"),
            "{name}: {body}"
        );
        let (_, metrics) = get(&state, "/metrics").await;
        assert!(metrics.contains("kvroute_state_rejected_total 1"), "{name}");
        state.stop_subscribers();
    }
}

/// Publishes `events` in a batch that names dp rank `dp`, as a data-parallel engine's
/// publisher for that rank would.
fn publish_dp(p: &Publisher, dp: u32, events: &[KvEvent]) -> u64 {
    let c = p.config();
    let wire: Vec<WireEvent> = events.iter().map(WireEvent::from).collect();
    p.publish(wire::encode_batch(c.format, c.extras, 1.0, &wire, Some(dp)))
}
