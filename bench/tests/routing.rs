//! The bench's KV-aware policies: kvroute routes by what the real collector learned from the
//! engines' ZMQ events; the oracle by the engines' exact caches.

use std::time::Duration;

use clap::Parser;
use kvroute_bench::routing::policy::{KvAware, MatchSource};
use kvroute_bench::routing::{start_collector, start_fleet, BenchArgs};
use kvroute_sim::replay::{Route, RouteRequest};

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    a: BenchArgs,
}

fn args() -> BenchArgs {
    Wrap::parse_from([
        "bench",
        "--engines",
        "3",
        "--capacity-blocks",
        "2000",
        "--speed",
        "1000",
    ])
    .a
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 100_000 + i).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvroute_and_oracle_route_to_the_engine_holding_the_prefix() {
    let a = args();
    let fleet = start_fleet(&a).await.unwrap();
    let collector = start_collector(&a, &fleet).await.unwrap();
    let kv = KvAware::new(
        fleet.slots(),
        MatchSource::Collector {
            client: reqwest::Client::new(),
            url: collector,
            model: "sim-model".into(),
        },
        16,
        1,
    );
    let oracle = KvAware::new(
        fleet.slots(),
        MatchSource::Oracle {
            engines: fleet.engines.clone(),
        },
        16,
        1,
    );
    // Engine i caches prompt i. The collector subscribes asynchronously, so keep publishing
    // (each engine re-announces nothing for a cached prompt: use fresh prompts) until its
    // index shows every engine's prompt, bounded.
    let mut ready = false;
    for round in 0..100u32 {
        for (i, e) in fleet.engines.iter().enumerate() {
            drop(
                e.submit(prompt(round * 10 + i as u32, 320), 1, None)
                    .await
                    .unwrap(),
            );
        }
        let mut all = true;
        for i in 0..3u32 {
            let mut p = prompt(round * 10 + i, 320);
            p.extend([1, 2, 3]);
            let d = kv
                .route(RouteRequest {
                    index: 0,
                    tokens: &p,
                })
                .await;
            kv.on_first_token(&d);
            kv.on_done(&d);
            all &= d.slot == i as usize;
        }
        if all {
            ready = true;
            // The oracle agrees, on exact contents.
            for i in 0..3u32 {
                let mut p = prompt(round * 10 + i, 320);
                p.push(9);
                let d = oracle
                    .route(RouteRequest {
                        index: 0,
                        tokens: &p,
                    })
                    .await;
                assert_eq!(d.slot, i as usize);
                assert_eq!(d.uncached_tokens, 1, "320 tokens cached of 321");
                oracle.on_first_token(&d);
                oracle.on_done(&d);
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ready, "kvroute never routed every prompt to its engine");
    assert_eq!(
        kv.query_errors.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}
