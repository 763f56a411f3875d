use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use kvroute::api::RegisterRequest;
use kvroute::mirror::Lease;
use kvroute_collector::AppState;
use kvroute_sim::publisher::{Publisher, PublisherConfig};
use kvroute_sim::wire::{stored, EventFormat};
use serde_json::json;
use tokio::runtime::Runtime;
use tokio::sync::oneshot;

use crate::common::*;

/// Upper bound of every eventual condition; never reached when things work.
const DEADLINE: Duration = Duration::from_secs(20);

/// A real collector serving on a loopback port, in-process.
struct Collector {
    addr: SocketAddr,
    state: AppState,
    stop: Option<oneshot::Sender<()>>,
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

impl Collector {
    fn start(rt: &Runtime) -> Collector {
        let _guard = rt.enter();
        let config = kvroute_collector::Config {
            default_serving_port: Some(8000),
            ..kvroute_collector::Config::default()
        };
        let state = kvroute_collector::start(config).expect("collector starts");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        rt.spawn(kvroute_collector::serve(
            listener,
            state.clone(),
            async move {
                let _ = rx.await;
            },
        ));
        Collector {
            addr,
            state,
            stop: Some(tx),
        }
    }

    fn register(&self, rt: &Runtime, instance: &str, p: &Publisher, address: &str) {
        let _guard = rt.enter();
        self.state
            .register(RegisterRequest {
                instance_id: instance.into(),
                endpoint: p.endpoint.clone(),
                replay_endpoint: p.replay_endpoint.clone(),
                model_name: "m".into(),
                tenant_id: None,
                block_size: BS,
                dp_rank: None,
                lora_name: None,
                cache_salt: None,
                address: Some(address.into()),
            })
            .expect("registered");
    }

    /// Publishes `prompt` as stored by `p`'s engine and waits until the collector has it
    /// (re-publishing an empty batch now and then: PUB/SUB drops what precedes the
    /// subscription, and the next sequence number makes the collector replay the gap).
    fn publish_and_wait(&self, rt: &Runtime, p: &mut Publisher, instance: &str, prompt: &[u32]) {
        rt.block_on(async {
            p.publish_events(&[stored(None, 1, prompt, BS as usize)]);
            let until = tokio::time::Instant::now() + DEADLINE;
            loop {
                let want = prompt.len() as u64;
                let ok = self
                    .state
                    .wait_until(Duration::from_millis(250), |hub| {
                        hub.query_tokens(prompt, "m", None, None, None)
                            .ok()
                            .and_then(|r| r.instances.get(instance).map(|m| m.longest_matched))
                            == Some(want)
                    })
                    .await;
                if ok {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < until,
                    "collector never indexed the blocks"
                );
                p.publish_events(&[]);
            }
        });
    }

    fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.stop();
        self.state.stop_subscribers();
    }
}

fn feed_workers(gw: &kvroute_host_test::Gateway) -> BTreeSet<usize> {
    gw.callouts()
        .iter()
        .filter(|c| c.path().starts_with("/v1/feed"))
        .map(|c| c.id.worker)
        .collect()
}

#[test]
fn local_mode_syncs_from_a_real_collector_through_restarts_and_outages() {
    let rt = runtime();
    let prompt = tokens(0, 64);
    // Registration → events → feed → routed request.
    let c1 = Collector::start(&rt);
    let mut p1 = rt
        .block_on(Publisher::start(PublisherConfig::loopback(
            EventFormat::Vllm033,
        )))
        .expect("bind");
    c1.register(&rt, "a", &p1, A);
    c1.publish_and_wait(&rt, &mut p1, "a", &prompt);
    let mut gw = gateway(&config(json!({})), 2);
    gw.cluster_forward(CLUSTER, c1.addr);
    sync(&mut gw);
    for worker in 0..2 {
        let o = gw
            .request()
            .worker(worker)
            .json_body(&json!({"model": "m", "prompt": prompt}))
            .send();
        assert_eq!(
            dest(&o),
            Some(A),
            "worker {worker} routes on the shared index"
        );
    }
    // Two VMs, one lease: the feed is pulled by one of them.
    for _ in 0..5 {
        sync(&mut gw);
    }
    assert_eq!(feed_workers(&gw).len(), 1, "one lease holder");

    // A restarted collector (new epoch) with other contents: the filter resyncs.
    let c2 = Collector::start(&rt);
    let mut p2 = rt
        .block_on(Publisher::start(PublisherConfig::loopback(
            EventFormat::Vllm033,
        )))
        .expect("bind");
    c2.register(&rt, "b", &p2, B);
    c2.publish_and_wait(&rt, &mut p2, "b", &prompt);
    gw.cluster_forward(CLUSTER, c2.addr);
    sync(&mut gw);
    sync(&mut gw);
    let o = complete(&mut gw, "m", &prompt);
    assert_eq!(
        dest(&o),
        Some(B),
        "the new epoch's index replaced the old one whole"
    );
    assert!(gw.metric("kvroute.resyncs").unwrap_or(0) >= 2);

    // The collector goes down: the index ages, then requests fail open.
    let dead = c2.addr;
    drop(c2);
    drop(p2);
    gw.cluster_forward(CLUSTER, dead);
    gw.advance(Duration::from_millis(5_200));
    let before = count(&gw, "stale_index");
    let o = complete(&mut gw, "m", &prompt);
    assert_fail_open(&gw, &o, "stale_index", before);
    assert!(gw.metric("kvroute.feed_errors").unwrap_or(0) > 0);

    // It comes back (the first collector's address): routed again.
    gw.cluster_forward(CLUSTER, c1.addr);
    sync(&mut gw);
    sync(&mut gw);
    let o = complete(&mut gw, "m", &prompt);
    assert_eq!(dest(&o), Some(A), "recovered");
    drop(p1);
}

#[test]
fn a_lapsed_lease_is_taken_over_by_another_vm() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    feed.hold(0, &tokens(0, 64), "default", "m", None, None);
    let mut gw = gateway(&config(json!({})), 2);
    feed.attach(&mut gw);
    // Another VM (a dead one) holds the lease for 2 more seconds.
    let now_ms = gw.now_nanos() / 1_000_000;
    gw.set_shared_data(
        keys().lease(),
        Lease {
            holder: 999_999,
            expires_ms: now_ms + 2_000,
        }
        .encode(),
    );
    for _ in 0..10 {
        sync(&mut gw);
    }
    assert_eq!(feed.pulls(), 0, "nobody pulls while the lease is held");
    let before = count(&gw, "stale_index");
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert_fail_open(&gw, &o, "stale_index", before);
    gw.advance(Duration::from_millis(1_500));
    assert!(feed.pulls() > 0, "the lease lapsed and a live VM took it");
    let lease = Lease::decode(&gw.shared_data(keys().lease()).unwrap().0).unwrap();
    assert_ne!(lease.holder, 999_999);
    assert_eq!(best(&complete(&mut gw, "m", &tokens(0, 64))), Some(A));
}

#[test]
fn a_resync_is_switched_in_whole_after_the_last_page() {
    use kvroute::feed::{Op, Page};
    use kvroute_host_test::{CalloutReply, Response};
    use std::sync::{Arc, Mutex};
    // A collector that answers a snapshot in three pages (RESET|MORE, MORE, last), one page
    // per tick thanks to a budget of one block per tick.
    let prompt = tokens(0, 64);
    let keys_a = keys_of(&prompt, "default", "m", None, None);
    let pages = [
        Page {
            flags: Page::RESET | Page::MORE,
            epoch: 5,
            cursor: 1,
            ops: vec![
                Op::Worker {
                    id: kvroute::event::WorkerId(0),
                    live: true,
                    dp_rank: 0,
                    instance_id: "a".into(),
                    address: A.into(),
                    tenant: "default".into(),
                    model: "m".into(),
                },
                Op::BlockSize {
                    tenant: "default".into(),
                    model: "m".into(),
                    block_size: BS,
                },
                Op::Blocks {
                    worker: kvroute::event::WorkerId(0),
                    tier: kvroute::event::Tier::Gpu,
                    added: true,
                    keys: keys_a[..2].to_vec(),
                },
            ],
        },
        Page {
            flags: Page::MORE,
            epoch: 5,
            cursor: 2,
            ops: vec![Op::Blocks {
                worker: kvroute::event::WorkerId(0),
                tier: kvroute::event::Tier::Gpu,
                added: true,
                keys: keys_a[2..].to_vec(),
            }],
        },
        Page {
            flags: 0,
            epoch: 5,
            cursor: 3,
            ops: vec![],
        },
    ];
    let served = Arc::new(Mutex::new(0usize));
    let s2 = served.clone();
    let mut gw = gateway(&config(json!({"index": {"max_blocks_per_tick": 1}})), 1);
    gw.cluster(CLUSTER, move |_| {
        let mut n = s2.lock().unwrap();
        let page = pages.get(*n).cloned().unwrap_or(Page {
            flags: 0,
            epoch: 5,
            cursor: 3,
            ops: vec![],
        });
        *n += 1;
        CalloutReply::Response(Response::ok(page.to_bytes()))
    });
    sync(&mut gw);
    assert_eq!(*served.lock().unwrap(), 1);
    let before = count(&gw, "stale_index");
    let o = complete(&mut gw, "m", &prompt);
    assert_fail_open(&gw, &o, "stale_index", before);
    sync(&mut gw);
    assert_eq!(*served.lock().unwrap(), 2);
    let o = complete(&mut gw, "m", &prompt);
    assert_fail_open(&gw, &o, "stale_index", before + 1);
    sync(&mut gw);
    let o = complete(&mut gw, "m", &prompt);
    assert_eq!(dest(&o), Some(A));
    assert!(debug(&o).contains("matched_tokens=64"), "{}", debug(&o));
}

#[test]
fn a_new_epoch_replaces_the_index_and_an_outage_recovers() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "default", "m", None, None);
    let mut gw = gateway(&config(json!({})), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
    // Restarted with b holding the prompt: the snapshot replaces a's blocks.
    feed.restart(false);
    two_instances(&feed);
    feed.hold(1, &prompt, "default", "m", None, None);
    sync(&mut gw);
    let o = complete(&mut gw, "m", &prompt);
    assert_eq!(
        dest(&o),
        Some(format!("{B},{A}").as_str()),
        "a only as runner-up: it holds nothing now"
    );
    // Down: stale after stale_after_ms, then back.
    feed.set_down(true);
    gw.advance(Duration::from_millis(5_100));
    let before = count(&gw, "stale_index");
    let o = complete(&mut gw, "m", &prompt);
    assert_fail_open(&gw, &o, "stale_index", before);
    feed.set_down(false);
    sync(&mut gw);
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(B));
}

#[test]
fn gateways_share_their_load_through_a_real_collector() {
    let rt = runtime();
    let prompt = tokens(0, 64);
    let c = Collector::start(&rt);
    let mut pa = rt
        .block_on(Publisher::start(PublisherConfig::loopback(
            EventFormat::Vllm033,
        )))
        .expect("bind");
    let pb = rt
        .block_on(Publisher::start(PublisherConfig::loopback(
            EventFormat::Vllm033,
        )))
        .expect("bind");
    c.register(&rt, "a", &pa, A);
    c.register(&rt, "b", &pb, B);
    c.publish_and_wait(&rt, &mut pa, "a", &prompt);
    let mut gw1 = gateway(&config(json!({"load": {"gateway_id": "gw-1"}})), 1);
    let mut gw2 = gateway(&config(json!({"load": {"gateway_id": "gw-2"}})), 1);
    gw1.cluster_forward(CLUSTER, c.addr);
    gw2.cluster_forward(CLUSTER, c.addr);
    sync(&mut gw1);
    sync(&mut gw2);
    // Gateway 1 sends three requests of a's cached prompt to a, and holds them.
    let held: Vec<_> = (0..3)
        .map(|_| {
            let r = gw1
                .request()
                .json_body(&json!({"model": "m", "prompt": prompt}))
                .hold_response()
                .start();
            assert_eq!(best(&gw1.outcome(r)), Some(A));
            r
        })
        .collect();
    // Its lease holder reports them (absolute counts) on its tick.
    sync(&mut gw1);
    let requests_on_a = |c: &Collector| {
        let table: Vec<_> = c
            .state
            .read()
            .workers()
            .map(|w| (w.id, w.reg.instance_id.clone()))
            .collect();
        let a = table.iter().find(|(_, i)| i == "a").map(|(id, _)| *id);
        c.state
            .fleet()
            .totals(std::time::Instant::now())
            .iter()
            .find(|t| Some(t.worker) == a)
            .map_or(0, |t| t.load.requests)
    };
    assert_eq!(requests_on_a(&c), 3);
    // Gateway 2 never saw them, but the feed carries the fleet's totals: its cold request
    // goes to b (idle) although a and b look alike in its own books.
    sync(&mut gw2);
    for i in 0..3 {
        let o = complete(&mut gw2, "m", &tokens(50_000 + i * 1000, 64));
        assert_eq!(best(&o), Some(B), "{}", debug(&o));
    }
    // Gateway 1's requests end: its next report says zero.
    for r in held {
        gw1.respond(r, kvroute_host_test::Response::ok("x"));
    }
    sync(&mut gw1);
    assert_eq!(requests_on_a(&c), 0);
}
