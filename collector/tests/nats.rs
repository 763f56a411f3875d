//! The NATS JetStream event bus (`--nats`, issue 23) against a real `nats-server -js` on a
//! free loopback port in a temp dir (installed by `tools/install-nats-server.sh` when absent):
//! engines' real vLLM and SGLang msgpack over ZMQ (`kvroute_sim::publisher`) into an ingest
//! collector, out of the stream into index replicas, compared with a direct-ZMQ collector;
//! a replica restarted on its durable consumer; bad input on the bus; NATS down at start and
//! mid-run.

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
mod natsd;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use common::{publisher, registration, tokens, DEADLINE};
use kvroute::event::{EngineHash, KvEvent, Tier};
use kvroute_collector::bus::{wire, BusConfig, Role};
use kvroute_collector::hub::Hub;
use kvroute_collector::{AppState, Config};
use kvroute_sim::publisher::Publisher;
use kvroute_sim::wire::{stored, EventFormat, ReplayShape};
use natsd::{bus, config, free_port, Collector, Nats};

const M: &str = "llama";

/// What a collector's index says about `prompts`, and how many blocks each worker holds:
/// equal for two collectors that applied the same events.
fn signature(hub: &Hub, prompts: &[Vec<u32>]) -> String {
    let mut out = BTreeMap::new();
    for (i, p) in prompts.iter().enumerate() {
        // An unknown model (no registration yet) is an error: an empty answer here.
        let Ok(r) = hub.query_tokens(p, M, None, None, None) else {
            continue;
        };
        for (inst, m) in r.instances {
            out.insert(
                format!("q{i}/{inst}"),
                (m.longest_matched, m.gpu, m.cpu, m.disk),
            );
        }
    }
    let mut blocks: Vec<(String, u32, u64)> = hub
        .worker_views()
        .into_iter()
        .map(|w| (w.instance_id, w.dp_rank, w.blocks))
        .collect();
    blocks.sort();
    format!("{out:?} {blocks:?}")
}

/// Waits until `a`'s signature equals `b`'s (and is not empty), or fails with both.
async fn converge(a: &AppState, b: &AppState, prompts: &[Vec<u32>]) {
    let until = tokio::time::Instant::now() + DEADLINE;
    loop {
        let (sa, sb) = (signature(&a.read(), prompts), signature(&b.read(), prompts));
        if sa == sb {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "indexes differ after {DEADLINE:?}:\n{sa}\n{sb}"
        );
        let _ = a.wait_until(Duration::from_millis(100), |_| false).await;
    }
}

/// Waits for `cond` on a collector's index, nudging `p` (an empty batch makes a collector
/// that missed the start of the stream replay).
async fn until(state: &AppState, p: &mut Publisher, cond: impl FnMut(&Hub) -> bool) {
    common::eventually(state, Some(p), cond).await;
}

/// A deterministic mix of stores, removals and a clear on two engines (vLLM and SGLang).
/// Returns the prompts the signature queries.
fn traffic(a: &Publisher, b: &Publisher, round: u32, batches: u32) -> Vec<Vec<u32>> {
    let mut prompts = Vec::new();
    for i in 0..batches {
        let base = round * 100_000 + i * 1000;
        let t = tokens(base + 1, 32);
        let h = u64::from(base) * 10 + 1;
        a.publish_events(&[stored(None, h, &t, 4)]);
        b.publish_events(&[stored(None, h + 5_000_000, &t[..16], 4)]);
        if i % 3 == 1 && i + 1 < batches {
            // Cut a's chain after 2 blocks (never the last prompt's: the tests wait on it).
            a.publish_events(&[KvEvent::BlockRemoved {
                hashes: vec![EngineHash(h + 2)],
                tier: Tier::Gpu,
            }]);
        }
        prompts.push(t);
    }
    prompts
}

/// Registers each named publisher's engine with `state` (model `M`, block size 4).
fn register(state: &AppState, engines: &[(&str, &Publisher)]) {
    for (name, p) in engines {
        state.register(registration(name, p, M, None, 4)).unwrap();
    }
}

/// Waits until `state` holds `last` as [`traffic`] leaves it: 32 tokens on a, 16 on b.
async fn until_both(state: &AppState, a: &mut Publisher, b: &mut Publisher, last: &[u32]) {
    until(state, a, |h| common::longest(h, last, M, None, "a") == 32).await;
    until(state, b, |h| common::longest(h, last, M, None, "b") == 16).await;
}

/// Unregisters `instance` (model `M`, every rank) from `state`.
fn unregister(state: &AppState, instance: &str) {
    state
        .unregister(&kvroute::api::UnregisterRequest {
            instance_id: instance.into(),
            model_name: M.into(),
            tenant_id: None,
            dp_rank: None,
        })
        .unwrap();
}

async fn registered(state: &AppState, n: usize) {
    assert!(
        state
            .wait_until(DEADLINE, |h| h
                .workers()
                .filter(|w| w.source.is_none())
                .count()
                == n)
            .await,
        "registrations did not arrive"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_replicas_agree_with_each_other_and_with_direct_zmq() {
    let nats = Nats::start().await;
    let url = nats.url();
    let ingest = Collector::start(config(Some(bus(&url, Role::Ingest, "unused")))).await;
    let direct = Collector::start(config(None)).await;
    let r1 = Collector::start(config(Some(bus(&url, Role::Index, "r1")))).await;
    let r2 = Collector::start(config(Some(bus(&url, Role::Index, "r2")))).await;
    let mut a = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    let mut b = publisher(EventFormat::Sglang, ReplayShape::New).await;
    for c in [&ingest, &direct] {
        register(&c.state, &[("a", &a), ("b", &b)]);
    }
    registered(&r1.state, 2).await;
    registered(&r2.state, 2).await;
    let mut prompts = traffic(&a, &b, 0, 30);
    let last = prompts[29].clone();
    for c in [&ingest, &direct] {
        until_both(&c.state, &mut a, &mut b, &last).await;
    }
    // A clear on a: every block of a goes.
    a.publish_events(&[KvEvent::AllBlocksCleared]);
    prompts.extend(traffic(&a, &b, 1, 5));
    let last = prompts.last().unwrap().clone();
    for c in [&ingest, &direct] {
        until_both(&c.state, &mut a, &mut b, &last).await;
        until(&c.state, &mut a, |h| {
            common::longest(h, &prompts[0], M, None, "a") == 0
        })
        .await;
    }
    converge(&ingest.state, &direct.state, &prompts).await;
    converge(&r1.state, &direct.state, &prompts).await;
    converge(&r2.state, &direct.state, &prompts).await;
    converge(&r1.state, &r2.state, &prompts).await;
    assert!(signature(&r1.state.read(), &prompts).contains("q34/a"));
    assert!(r1.bus_count("in", "applied") > 0);
    assert_eq!(r1.bus_count("in", "undecodable"), 0);
    assert_eq!(ingest.bus_count("out", "outbox_full"), 0);
    // An unregistration on a replica reaches the ingest side and the other replica.
    unregister(&r2.state, "b");
    registered(&ingest.state, 1).await;
    registered(&r1.state, 1).await;
    // Registered again (the same slot): its engine's buffer replayed from 0 on the ingest
    // and direct collectors, and the replicas take it as a new worker's, not as copies.
    unregister(&direct.state, "b");
    register(&ingest.state, &[("b", &b)]);
    register(&direct.state, &[("b", &b)]);
    let last = prompts.last().unwrap().clone();
    for c in [&ingest, &direct] {
        until(&c.state, &mut b, |h| {
            common::longest(h, &last, M, None, "b") == 16
        })
        .await;
    }
    converge(&ingest.state, &direct.state, &prompts).await;
    converge(&r1.state, &direct.state, &prompts).await;
    converge(&r2.state, &direct.state, &prompts).await;
    for c in [r1, r2, ingest, direct] {
        c.stop().await;
    }
}

/// Which of `ingests` reads `instance`'s engine (by index), once each reads what it owns.
fn readers(ingests: &[&Collector], instance: &str) -> Vec<usize> {
    ingests
        .iter()
        .enumerate()
        .filter(|(_, c)| {
            let id = c
                .state
                .read()
                .workers()
                .find(|w| w.reg.instance_id == instance)
                .map(|w| w.id);
            id.is_some_and(|id| c.state.reads(id))
        })
        .map(|(i, _)| i)
        .collect()
}

/// Waits until every engine of `names` is read by its rendezvous owner among `ingests` and by
/// no other ingest process.
async fn split_settles(ingests: &[&Collector], names: &[String]) {
    let origins: Vec<u64> = ingests
        .iter()
        .map(|c| c.state.bus.as_ref().unwrap().origin())
        .collect();
    let until = tokio::time::Instant::now() + DEADLINE;
    loop {
        let now: Vec<(String, Vec<usize>, usize)> = names
            .iter()
            .map(|n| {
                let key = kvroute_collector::bus::worker_key(n, 0);
                let owner = kvroute_collector::bus::ownership::owner(&origins, &key).unwrap();
                let at = origins.iter().position(|o| *o == owner).unwrap();
                (n.clone(), readers(ingests, n), at)
            })
            .collect();
        if now.iter().all(|(_, r, at)| r == &[*at]) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "engines not split one reader each: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Two ingest processes split six engines, one reader each: every batch reaches the stream
/// once (the replica sees no second copy) and the replica equals a direct collector. One
/// ingest process stops: the other takes its engines from the stream's last batch of each,
/// and what the engines publish next reaches the replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_processes_split_the_engines_and_take_over_a_stopped_ones() {
    let nats = Nats::start().await;
    let url = nats.url();
    // A short silence alarm: an ingest process must judge only the engines it reads.
    let ingest = || Config {
        alarm_silent: Duration::from_secs(1),
        ..config(Some(bus(&url, Role::Ingest, "unused")))
    };
    let i1 = Collector::start(ingest()).await;
    let i2 = Collector::start(ingest()).await;
    let direct = Collector::start(config(None)).await;
    let r1 = Collector::start(config(Some(bus(&url, Role::Index, "r1")))).await;
    let names: Vec<String> = (0..6).map(|i| format!("e{i}")).collect();
    let mut engines = Vec::new();
    for _ in &names {
        engines.push(publisher(EventFormat::Vllm033, ReplayShape::New).await);
    }
    let pairs: Vec<(&str, &Publisher)> = names.iter().map(|n| n.as_str()).zip(&engines).collect();
    register(&i1.state, &pairs);
    register(&direct.state, &pairs);
    registered(&i2.state, 6).await;
    registered(&r1.state, 6).await;
    split_settles(&[&i1, &i2], &names).await;
    // Each says on /health how many share the engines and how many it reads.
    let (h1, h2) = (i1.health().await, i2.health().await);
    assert_eq!(h1["ingest"]["members"], 2, "{h1}");
    assert_eq!(
        h1["ingest"]["reads"].as_u64().unwrap() + h2["ingest"]["reads"].as_u64().unwrap(),
        6,
        "{h1} {h2}"
    );
    let round = |engines: &[Publisher], round: u32| -> Vec<Vec<u32>> {
        let mut prompts = Vec::new();
        for (i, e) in engines.iter().enumerate() {
            for j in 0..4u32 {
                let base = round * 100_000 + (i as u32) * 1000 + j * 100;
                let t = tokens(base + 1, 16);
                e.publish_events(&[stored(None, u64::from(base) * 10 + 1, &t, 4)]);
                prompts.push(t);
            }
        }
        prompts
    };
    let mut prompts = round(&engines, 0);
    for (k, n) in names.iter().enumerate() {
        let last = prompts[k * 4 + 3].clone();
        until(&direct.state, &mut engines[k], |h| {
            common::longest(h, &last, M, None, n) == 16
        })
        .await;
        until(&r1.state, &mut engines[k], |h| {
            common::longest(h, &last, M, None, n) == 16
        })
        .await;
    }
    converge(&r1.state, &direct.state, &prompts).await;
    assert_eq!(
        r1.bus_count("in", "duplicate"),
        0,
        "a batch reached the stream twice"
    );
    assert!(i1.bus_count("out", "published") > 0 && i2.bus_count("out", "published") > 0);
    // Every engine serves requests and sends no event for over a second: i1 raises
    // engine_silent for engines it reads, never for one the other process reads.
    let busy_everywhere = || async {
        let (epoch, workers) = fleet_load(&i1).await;
        let entries: Vec<serde_json::Value> = workers
            .values()
            .map(|w| serde_json::json!({ "worker": w.0, "requests": 1, "prefill_tokens": 10 }))
            .collect();
        let r = reqwest::Client::new()
            .post(format!("http://{}/v1/load", i1.addr))
            .json(&serde_json::json!({ "gateway": "gw", "epoch": epoch, "workers": entries }))
            .send()
            .await
            .expect("POST /v1/load");
        assert!(r.status().is_success());
    };
    busy_everywhere().await;
    // Alarms are judged when asked: this opens the silence window, the next one judges it.
    i1.health().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    busy_everywhere().await;
    let h = i1.health().await;
    let silent: Vec<String> = h["alarms"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["alarm"] == "engine_silent")
        .map(|a| {
            a["subject"]
                .as_str()
                .unwrap()
                .trim_end_matches("/0")
                .to_owned()
        })
        .collect();
    assert!(!silent.is_empty(), "the silence alarm never fired: {h}");
    for n in &silent {
        assert_eq!(readers(&[&i1, &i2], n), [0], "{n} is not read by i1: {h}");
    }
    // i1 stops: i2 reads all six once i1's membership has lapsed.
    i1.stop().await;
    split_settles(&[&i2], &names).await;
    prompts.extend(round(&engines, 1));
    for (k, n) in names.iter().enumerate() {
        let last = prompts[24 + k * 4 + 3].clone();
        until(&r1.state, &mut engines[k], |h| {
            common::longest(h, &last, M, None, n) == 16
        })
        .await;
    }
    converge(&r1.state, &direct.state, &prompts).await;
    for c in [r1, i2, direct] {
        c.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_index_replica_resumes_from_its_durable_consumer_and_keeps_its_readers() {
    let nats = Nats::start().await;
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let replica_config = || Config {
        state_dir: Some(dir.path().to_owned()),
        ..config(Some(bus(&url, Role::Index, "restarting")))
    };
    let ingest = Collector::start(config(Some(bus(&url, Role::Ingest, "unused")))).await;
    let r = Collector::start(replica_config()).await;
    let mut a = publisher(EventFormat::Vllm023, ReplayShape::Old).await;
    let mut b = publisher(EventFormat::SglangLegacy, ReplayShape::New).await;
    register(&ingest.state, &[("a", &a), ("b", &b)]);
    registered(&r.state, 2).await;
    let mut prompts = traffic(&a, &b, 0, 40);
    let last = prompts[39].clone();
    until_both(&ingest.state, &mut a, &mut b, &last).await;
    converge(&r.state, &ingest.state, &prompts).await;
    let first_run = r.bus_count("in", "applied");
    // A gateway follows the replica up to here.
    let mut gw = Mirror::new();
    assert_eq!(gw.pull(&r).await[0], Took::Snapshot);
    r.stop().await;
    // While the replica is away: more events (a clear among them), into the stream only.
    a.publish_events(&[KvEvent::AllBlocksCleared]);
    prompts.extend(traffic(&a, &b, 1, 5));
    let last = prompts.last().unwrap().clone();
    until_both(&ingest.state, &mut a, &mut b, &last).await;
    let r = Collector::start(replica_config()).await;
    // The gateway asks at once: it waits (empty deltas) until the replica has caught up with
    // where it was, then is taken over, never sent a snapshot.
    let mut took = Vec::new();
    let until = tokio::time::Instant::now() + DEADLINE;
    while !took.contains(&Took::Handover) {
        assert!(tokio::time::Instant::now() < until, "no handover: {took:?}");
        took.extend(gw.pull(&r).await);
        assert!(!took.contains(&Took::Snapshot), "{took:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    converge(&r.state, &ingest.state, &prompts).await;
    // It resumed after what it had acknowledged: the first run's batches were not applied again.
    let second_run = r.bus_count("in", "applied");
    assert!(
        second_run < first_run / 2,
        "the restarted replica applied {second_run} messages (first run: {first_run}): not resumed"
    );
    // The gateway's index, followed on from the handover, is what a fresh snapshot gives.
    let took = gw.pull(&r).await;
    assert!(!took.contains(&Took::Snapshot), "{took:?}");
    let mut fresh = Mirror::new();
    assert_eq!(fresh.pull(&r).await[0], Took::Snapshot);
    let keys: Vec<u64> = gw.seen.union(&fresh.seen).copied().collect();
    assert!(keys.len() > 40, "{} keys", keys.len());
    let differ = keys
        .iter()
        .filter(|&&k| gw.holders(k) != fresh.holders(k))
        .count();
    assert_eq!(differ, 0, "{differ} of {} keys differ", keys.len());
    r.stop().await;
    ingest.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_the_bus_is_counted_and_skipped() {
    let nats = Nats::start().await;
    let url = nats.url();
    // The ingest side makes the stream (limit 1 MiB); this replica reads only 4 KiB messages.
    let ingest = Collector::start(config(Some(bus(&url, Role::Ingest, "unused")))).await;
    let r = Collector::start(config(Some(BusConfig {
        max_message_bytes: 4096,
        ..bus(&url, Role::Index, "strict")
    })))
    .await;
    let mut a = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    register(&ingest.state, &[("a", &a)]);
    registered(&r.state, 1).await;
    let t = tokens(1, 16);
    a.publish_events(&[stored(None, 10, &t, 4)]);
    until(&ingest.state, &mut a, |h| {
        common::longest(h, &t, M, None, "a") == 16
    })
    .await;
    converge(&r.state, &ingest.state, std::slice::from_ref(&t)).await;
    // a's next sequence number (a slow start may have nudged a with empty batches).
    let next = ingest
        .state
        .read()
        .workers()
        .find(|w| w.reg.instance_id == "a")
        .and_then(|w| w.status.last_seq)
        .expect("a's last batch")
        + 1;

    let client = async_nats::connect(&url).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    let subject = "kvroute.events.test.x-dp0";
    let publish = |body: Bytes| {
        let js = js.clone();
        async move {
            js.publish(subject, body)
                .await
                .expect("publish")
                .await
                .expect("ack");
        }
    };
    // Not an envelope.
    publish(Bytes::from_static(b"\xc1garbage")).await;
    // An envelope whose batch is not msgpack (a's next sequence number).
    publish(wire::encode(wire::Kind::Batch, next, 0, "a", b"\xc1\xc1")).await;
    // A worker nobody registered.
    publish(wire::encode(wire::Kind::Connected, 0, 0, "nobody", b"")).await;
    // Over this replica's limit (the stream takes it).
    let big_payload = vec![0u8; 8192];
    publish(wire::encode(
        wire::Kind::Batch,
        next + 1,
        0,
        "a",
        &big_payload,
    ))
    .await;
    // A real batch of a, after a jump in its sequence numbers: counted as a gap, applied.
    let t2 = tokens(500, 8);
    let payload = kvroute_sim::wire::encode_events(
        EventFormat::Vllm033,
        kvroute_sim::wire::Extras::engine(EventFormat::Vllm033),
        1.0,
        &[stored(None, 77, &t2, 4)],
        None,
    );
    publish(wire::encode(wire::Kind::Batch, 5000, 0, "a", &payload)).await;
    assert!(
        r.state
            .wait_until(DEADLINE, |h| common::longest(h, &t2, M, None, "a") == 8)
            .await,
        "the good batch after the bad ones was not applied"
    );
    assert_eq!(r.bus_count("in", "undecodable"), 2);
    assert_eq!(r.bus_count("in", "unknown_worker"), 1);
    assert_eq!(r.bus_count("in", "too_large"), 1);
    assert_eq!(r.bus_count("in", "gap"), 1);
    // Still serving, and the first batch is still there.
    assert_eq!(common::longest(&r.state.read(), &t, M, None, "a"), 16);
    assert_eq!(r.health().await["status"], "ok");
    r.stop().await;
    ingest.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_at_start_and_mid_run() {
    let mut nats = Nats::later();
    let url = nats.url();
    // Down at start: the collector starts, reads its engine over ZMQ, serves, says degraded.
    let both = Collector::start(config(Some(bus(&url, Role::Both, "unused")))).await;
    let mut a = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    register(&both.state, &[("a", &a)]);
    let t1 = tokens(1, 16);
    a.publish_events(&[stored(None, 10, &t1, 4)]);
    until(&both.state, &mut a, |h| {
        common::longest(h, &t1, M, None, "a") == 16
    })
    .await;
    let h = both.health().await;
    assert_eq!(h["status"], "degraded", "{h}");
    assert!(
        h["reasons"].to_string().contains("nats: not connected"),
        "{h}"
    );

    // An index replica started while NATS is down serves (nothing yet) and says why.
    let r = Collector::start(config(Some(bus(&url, Role::Index, "r")))).await;
    let h = r.health().await;
    assert_eq!(h["status"], "degraded", "{h}");
    assert!(
        h["reasons"].to_string().contains("nats: not connected"),
        "{h}"
    );

    // NATS comes: the outbox drains, the replica builds the same index.
    nats.up().await;
    converge(&r.state, &both.state, std::slice::from_ref(&t1)).await;
    wait_health(&both, "ok").await;
    wait_health(&r, "ok").await;

    // NATS goes mid-run: both keep serving; the replica keeps what it has.
    nats.down();
    wait_health(&both, "degraded").await;
    wait_health(&r, "degraded").await;
    let t2 = tokens(1000, 16);
    a.publish_events(&[stored(None, 20, &t2, 4)]);
    until(&both.state, &mut a, |h| {
        common::longest(h, &t2, M, None, "a") == 16
    })
    .await;
    assert_eq!(common::longest(&r.state.read(), &t1, M, None, "a"), 16);
    let q = reqwest::Client::new()
        .post(format!("http://{}/query", r.addr))
        .json(&serde_json::json!({ "token_ids": t1, "model_name": M }))
        .send()
        .await
        .expect("query while NATS is down");
    assert!(q.status().is_success());

    // NATS back: the replica catches up from the stream.
    nats.up().await;
    converge(&r.state, &both.state, &[t1.clone(), t2.clone()]).await;
    wait_health(&both, "ok").await;
    wait_health(&r, "ok").await;
    r.stop().await;
    both.stop().await;
}

async fn wait_health(c: &Collector, want: &str) {
    let until = tokio::time::Instant::now() + DEADLINE;
    loop {
        let h = c.health().await;
        if h["status"] == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "health not {want} within {DEADLINE:?}: {h}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `instance`'s stream is connected, as `state` has it.
fn connected(state: &AppState, instance: &str) -> Option<bool> {
    state
        .read()
        .workers()
        .find(|w| w.reg.instance_id == instance)
        .map(|w| w.status.connected)
}

async fn until_connected(state: &AppState, instance: &str, want: bool) {
    assert!(
        state
            .wait_until(DEADLINE, |h| {
                h.workers()
                    .any(|w| w.reg.instance_id == instance && w.status.connected == want)
            })
            .await,
        "{instance} connected != {want}: {:?}",
        connected(state, instance)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_stream_events_reach_the_replicas_every_time() {
    let nats = Nats::start().await;
    let url = nats.url();
    let ingest = Collector::start(config(Some(bus(&url, Role::Ingest, "unused")))).await;
    let r = Collector::start(config(Some(bus(&url, Role::Index, "events")))).await;
    let a = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    let (endpoint, replay) = (a.endpoint.clone(), a.replay_endpoint.clone().unwrap());
    register(&ingest.state, &[("a", &a)]);
    let mut a = Some(a);
    // Twice the same disconnect and reconnect, within JetStream's duplicate window.
    for _ in 0..2 {
        until_connected(&ingest.state, "a", true).await;
        until_connected(&r.state, "a", true).await;
        a.take().unwrap().close().await;
        until_connected(&ingest.state, "a", false).await;
        until_connected(&r.state, "a", false).await;
        a = Some(common::publisher_on(&endpoint, &replay, EventFormat::Vllm033).await);
    }
    until_connected(&r.state, "a", true).await;
    r.stop().await;
    ingest.stop().await;
}

/// `GET /v1/load` of `c`: the epoch and, per instance, (worker id, requests, prefill tokens).
async fn fleet_load(c: &Collector) -> (u64, BTreeMap<String, (u64, u64, u64)>) {
    let v: serde_json::Value = reqwest::get(format!("http://{}/v1/load", c.addr))
        .await
        .expect("GET /v1/load")
        .json()
        .await
        .expect("load JSON");
    let mut out = BTreeMap::new();
    for w in v["workers"].as_array().into_iter().flatten() {
        out.insert(
            w["instance_id"].as_str().unwrap_or("").to_owned(),
            (
                w["worker"].as_u64().unwrap_or(0),
                w["requests"].as_u64().unwrap_or(0),
                w["prefill_tokens"].as_u64().unwrap_or(0),
            ),
        );
    }
    (v["epoch"].as_u64().unwrap_or(0), out)
}

async fn post_load(c: &Collector, gateway: &str, instance: &str, requests: u64, prefill: u64) {
    let (epoch, workers) = fleet_load(c).await;
    let worker = workers[instance].0;
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/load", c.addr))
        .json(&serde_json::json!({
            "gateway": gateway,
            "epoch": epoch,
            "workers": [{ "worker": worker, "requests": requests, "prefill_tokens": prefill }],
        }))
        .send()
        .await
        .expect("POST /v1/load");
    assert!(
        r.status().is_success(),
        "{}",
        r.text().await.unwrap_or_default()
    );
}

async fn until_load(c: &Collector, instance: &str, requests: u64, prefill: u64) {
    let until = tokio::time::Instant::now() + DEADLINE;
    loop {
        let (_, w) = fleet_load(c).await;
        let got = w.get(instance).map(|w| (w.1, w.2));
        if got == Some((requests, prefill)) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{instance}: load {got:?}, want {:?}",
            (requests, prefill)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_load_reports_reach_every_replica() {
    let nats = Nats::start().await;
    let url = nats.url();
    let ingest = Collector::start(config(Some(bus(&url, Role::Both, "unused")))).await;
    let a = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    let b = publisher(EventFormat::Sglang, ReplayShape::New).await;
    let c = publisher(EventFormat::Sglang, ReplayShape::New).await;
    // c takes the ingest's slot 0 and goes: the replica, started after, gives b slot 0 and a
    // slot 1, the ingest the other way round.
    register(&ingest.state, &[("c", &c), ("b", &b)]);
    unregister(&ingest.state, "c");
    // Two registrations and the unregistration written to the registry before the replica starts.
    let until_written = tokio::time::Instant::now() + DEADLINE;
    while ingest.bus_count("out", "registry") < 3 {
        assert!(
            tokio::time::Instant::now() < until_written,
            "registry not written"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = Collector::start(config(Some(bus(&url, Role::Index, "load")))).await;
    registered(&r.state, 1).await;
    register(&ingest.state, &[("a", &a)]);
    registered(&r.state, 2).await;
    let (_, wi) = fleet_load(&ingest).await;
    let (_, wr) = fleet_load(&r).await;
    assert_ne!(wi["a"].0, wr["a"].0, "the test needs different worker ids");
    // Gateway g1 reports to the ingest collector, g2 to the replica: both sum both.
    post_load(&ingest, "g1", "a", 3, 300).await;
    post_load(&r, "g2", "a", 2, 200).await;
    post_load(&r, "g2b", "b", 1, 10).await;
    for c in [&ingest, &r] {
        until_load(c, "a", 5, 500).await;
        until_load(c, "b", 1, 10).await;
    }
    // A new report replaces the gateway's last one everywhere. It carries a decision for
    // a, named by the ingest's worker id: the replica hands it to g2 under its own id.
    let (epoch, _) = fleet_load(&ingest).await;
    let r1 = reqwest::Client::new()
        .post(format!("http://{}/v1/load", ingest.addr))
        .json(&serde_json::json!({
            "gateway": "g1", "epoch": epoch, "workers": [],
            "held": [{"worker": wi["a"].0, "shard": 2, "key": 77, "blocks": 3, "ttl_ms": 5000}],
        }))
        .send()
        .await
        .expect("POST /v1/load");
    assert!(r1.status().is_success());
    until_load(&r, "a", 2, 200).await;
    assert!(r.bus_count("in", "load_applied") >= 2);
    let page = reqwest::get(format!("http://{}/v1/feed?v=4&gateway=g2", r.addr))
        .await
        .expect("GET /v1/feed")
        .bytes()
        .await
        .expect("feed page");
    let held: Vec<_> = kvroute::feed::Page::decode(&page)
        .expect("a feed page")
        .ops
        .into_iter()
        .filter_map(|op| match op {
            kvroute::feed::Op::Held {
                worker,
                key,
                blocks,
                ..
            } => Some((u64::from(worker.0), key.0, blocks)),
            _ => None,
        })
        .collect();
    assert_eq!(held, [(wr["a"].0, 77, 3)]);
    r.stop().await;
    ingest.stop().await;
}

/// The real binary as an index replica, killed with SIGKILL by the test.
struct Replica {
    child: Child,
    addr: std::net::SocketAddr,
}

impl Replica {
    async fn start(url: &str, dir: &Path) -> Replica {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_kvroute-collector"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args([
                "--nats",
                url,
                "--nats-role",
                "index",
                "--nats-durable",
                "killed",
            ])
            .arg("--state-dir")
            .arg(dir)
            .args([
                "--snapshot-interval-secs",
                "0.2",
                "--scrape-interval-secs",
                "0",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kvroute-collector");
        let r = Replica {
            child,
            addr: ([127, 0, 0, 1], port).into(),
        };
        let until = tokio::time::Instant::now() + DEADLINE;
        while reqwest::get(format!("http://{}/health", r.addr))
            .await
            .is_err()
        {
            assert!(tokio::time::Instant::now() < until, "replica did not serve");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        r
    }

    /// The replica's [`signature`], read over HTTP.
    async fn signature(&self, prompts: &[Vec<u32>]) -> String {
        let http = reqwest::Client::new();
        let mut out = BTreeMap::new();
        for (i, p) in prompts.iter().enumerate() {
            let r = http
                .post(format!("http://{}/query", self.addr))
                .json(&serde_json::json!({ "token_ids": p, "model_name": M }))
                .send()
                .await
                .expect("query");
            if !r.status().is_success() {
                continue;
            }
            let r: kvroute::api::QueryResponse = r.json().await.expect("query JSON");
            for (inst, m) in r.instances {
                out.insert(
                    format!("q{i}/{inst}"),
                    (m.longest_matched, m.gpu, m.cpu, m.disk),
                );
            }
        }
        let workers: serde_json::Value = http
            .get(format!("http://{}/workers", self.addr))
            .send()
            .await
            .expect("workers")
            .json()
            .await
            .expect("workers JSON");
        let mut blocks: Vec<(String, u32, u64)> = workers["workers"]
            .as_array()
            .map(|ws| {
                ws.iter()
                    .map(|w| {
                        (
                            w["instance_id"].as_str().unwrap_or("").to_owned(),
                            w["dp_rank"].as_u64().unwrap_or(0) as u32,
                            w["blocks"].as_u64().unwrap_or(0),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        blocks.sort();
        format!("{out:?} {blocks:?}")
    }

    async fn converge(&self, to: &AppState, prompts: &[Vec<u32>]) {
        let until = tokio::time::Instant::now() + DEADLINE;
        loop {
            let (mine, theirs) = (
                self.signature(prompts).await,
                signature(&to.read(), prompts),
            );
            if mine == theirs {
                return;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "replica differs after {DEADLINE:?}:\n{mine}\n{theirs}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads the replica's cursor file (0 when absent).
fn cursor(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join(kvroute_collector::bus::handle::CURSOR_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_index_replica_recovers_from_its_snapshot_and_the_stream() {
    let nats = Nats::start().await;
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let ingest = Collector::start(config(Some(bus(&url, Role::Ingest, "unused")))).await;
    let mut a = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    let mut b = publisher(EventFormat::Sglang, ReplayShape::New).await;
    register(&ingest.state, &[("a", &a), ("b", &b)]);
    let r = Replica::start(&url, dir.path()).await;
    let mut prompts = traffic(&a, &b, 0, 20);
    let last = prompts.last().unwrap().clone();
    until_both(&ingest.state, &mut a, &mut b, &last).await;
    r.converge(&ingest.state, &prompts).await;
    // A snapshot with its cursor is on disk.
    let until_snap = tokio::time::Instant::now() + DEADLINE;
    while cursor(dir.path()) == 0 {
        assert!(tokio::time::Instant::now() < until_snap, "no cursor file");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // More events, applied and acknowledged by the replica, then SIGKILL: whether or not a
    // snapshot took them, the restarted replica must hold them.
    prompts.extend(traffic(&a, &b, 1, 6));
    a.publish_events(&[KvEvent::AllBlocksCleared]);
    prompts.extend(traffic(&a, &b, 2, 3));
    let last = prompts.last().unwrap().clone();
    until_both(&ingest.state, &mut a, &mut b, &last).await;
    until(&ingest.state, &mut a, |h| {
        common::longest(h, &prompts[0], M, None, "a") == 0
    })
    .await;
    r.converge(&ingest.state, &prompts).await;
    r.kill();
    let r = Replica::start(&url, dir.path()).await;
    r.converge(&ingest.state, &prompts).await;
    // And a replica whose snapshot is gone starts over from the stream.
    r.kill();
    std::fs::remove_file(dir.path().join("state.json")).unwrap();
    let r = Replica::start(&url, dir.path()).await;
    r.converge(&ingest.state, &prompts).await;
    r.kill();
    ingest.stop().await;
}

/// The bus's throughput (not a pass/fail test): batches of 64 blocks of 16 tokens pushed
/// through an ingest role's outbox onto the stream, and applied by an index replica reading
/// as they come; then by a second replica started once all of it is on the stream.
/// `cargo test --profile native -p kvroute-collector --test nats ingest_rate -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn ingest_rate_through_nats() {
    const BATCHES: u64 = 20_000;
    const BLOCKS: u32 = 64;
    const BLOCK_TOKENS: u32 = 16;
    let nats = Nats::start().await;
    let url = nats.url();
    // A stream that holds the whole run (~130 MB): the replica applies behind the publisher,
    // and the tests' 64 MB would drop what it has not read yet (counted as gaps).
    let roomy = |role, durable| BusConfig {
        outbox_batches: BATCHES as usize + 1024,
        max_bytes: 1 << 30,
        ..bus(&url, role, durable)
    };
    let ingest = Collector::start(config(Some(roomy(Role::Ingest, "unused")))).await;
    let r = Collector::start(config(Some(roomy(Role::Index, "rate")))).await;
    let reg = kvroute::api::RegisterRequest {
        instance_id: "bench".into(),
        endpoint: "tcp://127.0.0.1:9".into(),
        replay_endpoint: None,
        model_name: M.into(),
        tenant_id: None,
        block_size: BLOCK_TOKENS,
        dp_rank: None,
        lora_name: None,
        cache_salt: None,
        address: Some("127.0.0.1:8000".into()),
    };
    ingest.state.register(reg).unwrap();
    registered(&r.state, 1).await;
    let reg = ingest.state.read().workers().next().unwrap().reg.clone();
    let route = kvroute_collector::bus::Route::new(ingest.state.bus.clone().unwrap(), &reg, 0);
    let payloads: Vec<Vec<u8>> = (0..BATCHES)
        .map(|i| {
            let base = (i as u32) * BLOCKS * BLOCK_TOKENS;
            let t = tokens(base, BLOCKS * BLOCK_TOKENS);
            kvroute_sim::wire::encode_events(
                EventFormat::Vllm033,
                kvroute_sim::wire::Extras::engine(EventFormat::Vllm033),
                1.0,
                &[stored(None, i * 1000 + 1, &t, BLOCK_TOKENS as usize)],
                None,
            )
        })
        .collect();
    let bytes: usize = payloads.iter().map(Vec::len).sum();
    let started = std::time::Instant::now();
    for (seq, p) in payloads.iter().enumerate() {
        route.publish(&ingest.state.metrics, wire::Kind::Batch, seq as u64, p);
    }
    let until = tokio::time::Instant::now() + Duration::from_secs(600);
    while ingest.bus_count("out", "published") < BATCHES {
        assert!(tokio::time::Instant::now() < until);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let published = started.elapsed();
    let until = tokio::time::Instant::now() + Duration::from_secs(120);
    while r.bus_count("in", "applied") < BATCHES {
        let counts: Vec<(&str, u64)> = [
            "applied",
            "duplicate",
            "gap",
            "unknown_worker",
            "undecodable",
            "too_large",
        ]
        .into_iter()
        .map(|o| (o, r.bus_count("in", o)))
        .collect();
        assert!(
            tokio::time::Instant::now() < until,
            "the replica stopped at {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let applied = started.elapsed();
    // A replica started once it is all on the stream: its own rate, sharing the cores with
    // nats-server only (what a replica on its own machine, or one catching up, sees).
    let late = Collector::start(config(Some(roomy(Role::Index, "late")))).await;
    let caught_up_from = std::time::Instant::now();
    while late.bus_count("in", "applied") < BATCHES {
        assert!(
            tokio::time::Instant::now() < until,
            "the late replica stalled"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let caught_up = caught_up_from.elapsed();
    let blocks = (BATCHES * u64::from(BLOCKS)) as f64;
    println!(
        "{BATCHES} batches x {BLOCKS} blocks ({:.1} MB): on the stream (acknowledged) in {:.2} s = {:.0} blocks/s, {:.0} batches/s; applied by an index replica in {:.2} s = {:.0} blocks/s",
        bytes as f64 / 1e6,
        published.as_secs_f64(),
        blocks / published.as_secs_f64(),
        BATCHES as f64 / published.as_secs_f64(),
        applied.as_secs_f64(),
        blocks / applied.as_secs_f64(),
    );
    println!(
        "a replica started after the publish applied the stream in {:.2} s = {:.0} blocks/s",
        caught_up.as_secs_f64(),
        blocks / caught_up.as_secs_f64(),
    );
    assert_eq!(r.bus_count("in", "gap"), 0);
    assert_eq!(late.bus_count("in", "gap"), 0);
    late.stop().await;
    r.stop().await;
    ingest.stop().await;
}

/// What the bus adds to an event's way into an index replica (not a pass/fail test): one
/// small batch at a time, from the ingest side's outbox to the replica's index.
/// `cargo test --profile native -p kvroute-collector --test nats latency -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn latency_through_nats() {
    const N: u64 = 1000;
    let nats = Nats::start().await;
    let url = nats.url();
    let ingest = Collector::start(config(Some(bus(&url, Role::Ingest, "unused")))).await;
    let r = Collector::start(config(Some(bus(&url, Role::Index, "latency")))).await;
    let reg = kvroute::api::RegisterRequest {
        instance_id: "bench".into(),
        endpoint: "tcp://127.0.0.1:9".into(),
        replay_endpoint: None,
        model_name: M.into(),
        tenant_id: None,
        block_size: 16,
        dp_rank: None,
        lora_name: None,
        cache_salt: None,
        address: Some("127.0.0.1:8000".into()),
    };
    ingest.state.register(reg).unwrap();
    registered(&r.state, 1).await;
    let reg = ingest.state.read().workers().next().unwrap().reg.clone();
    let route = kvroute_collector::bus::Route::new(ingest.state.bus.clone().unwrap(), &reg, 0);
    let mut took = Vec::with_capacity(N as usize);
    for seq in 0..N {
        let t = tokens(seq as u32 * 64, 64);
        let payload = kvroute_sim::wire::encode_events(
            EventFormat::Vllm033,
            kvroute_sim::wire::Extras::engine(EventFormat::Vllm033),
            1.0,
            &[stored(None, seq * 10 + 1, &t, 16)],
            None,
        );
        let started = std::time::Instant::now();
        route.publish(&ingest.state.metrics, wire::Kind::Batch, seq, &payload);
        assert!(
            r.state
                .wait_until(DEADLINE, |h| h
                    .workers()
                    .any(|w| w.status.last_seq == Some(seq)))
                .await
        );
        took.push(started.elapsed());
    }
    took.sort();
    let q = |p: f64| took[((took.len() as f64 * p) as usize).min(took.len() - 1)];
    println!(
        "{N} batches one at a time, outbox to a replica's index: p50 {:?}, p99 {:?}, max {:?}",
        q(0.5),
        q(0.99),
        took[took.len() - 1]
    );
    r.stop().await;
    ingest.stop().await;
}

/// A gateway's mirror as the filter keeps it (shared data, here a [`kvroute::mirror::MemStore`])
/// pulling `/v1/feed` over HTTP: what a handover must leave equal to a snapshot.
struct Mirror {
    store: kvroute::mirror::MemStore,
    keys: kvroute::mirror::Keys,
    limits: kvroute::mirror::Limits,
    /// Every block key any page named.
    seen: std::collections::BTreeSet<u64>,
}

/// How one page was taken.
#[derive(Debug, PartialEq, Eq)]
enum Took {
    Snapshot,
    Delta,
    Handover,
    Refused,
}

impl Mirror {
    fn new() -> Mirror {
        Mirror {
            store: kvroute::mirror::MemStore::new(),
            keys: kvroute::mirror::Keys::new("t"),
            limits: kvroute::mirror::Limits {
                buckets_log2: 8,
                max_workers: 64,
                max_bucket_keys: 4096,
                max_models: 16,
            },
            seen: Default::default(),
        }
    }

    /// Pulls from `c` until it is caught up; how each page was taken.
    async fn pull(&mut self, c: &Collector) -> Vec<Took> {
        use kvroute::feed::{Op, Page};
        use kvroute::mirror::{apply_page, read_state, SyncError};
        let mut took = Vec::new();
        for _ in 0..1000 {
            let (state, _) = read_state(&self.store, &self.keys).unwrap();
            let url = format!("http://{}/v1/feed{}", c.addr, state.feed_query());
            let body = reqwest::get(url).await.unwrap().bytes().await.unwrap();
            let page = Page::decode(&body).unwrap();
            for op in &page.ops {
                if let Op::Blocks { keys, .. } = op {
                    self.seen.extend(keys.iter().map(|k| k.0));
                }
            }
            let kind = if page.is_reset() {
                Took::Snapshot
            } else if page.is_handover() {
                Took::Handover
            } else {
                Took::Delta
            };
            match apply_page(&self.store, &self.keys, &self.limits, &page, 1) {
                Ok(a) => {
                    took.push(kind);
                    if !a.more {
                        return took;
                    }
                }
                Err(SyncError::HandoverRefused(_) | SyncError::EpochMismatch { .. }) => {
                    took.push(Took::Refused)
                }
                Err(e) => panic!("page not applied: {e}"),
            }
        }
        panic!("never caught up: {took:?}");
    }

    /// The holders of `key` in the mirror's active index.
    fn holders(&self, key: u64) -> Vec<(kvroute::event::WorkerId, kvroute::lookup::TierMask)> {
        use kvroute::lookup::HolderView;
        let (state, _) = kvroute::mirror::read_state(&self.store, &self.keys).unwrap();
        let view = kvroute::mirror::BucketView::new(
            &self.store,
            &self.keys,
            &state,
            self.limits.buckets_log2,
        );
        let mut out = Vec::new();
        view.holders(kvroute::scope::BlockKey(key), &mut out);
        out
    }
}

/// Issue 23: a gateway that followed one index replica goes on from another replica of the
/// same stream without a snapshot, and ends with the index a snapshot would give it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_replica_of_the_stream_takes_a_reader_over_without_a_snapshot() {
    let nats = Nats::start().await;
    let url = nats.url();
    let ingest = Collector::start(config(Some(bus(&url, Role::Ingest, "unused")))).await;
    let r1 = Collector::start(config(Some(bus(&url, Role::Index, "r1")))).await;
    let r2 = Collector::start(config(Some(bus(&url, Role::Index, "r2")))).await;
    let direct = Collector::start(config(None)).await;
    let mut a = publisher(EventFormat::Vllm033, ReplayShape::New).await;
    let mut b = publisher(EventFormat::Sglang, ReplayShape::New).await;
    register(&ingest.state, &[("a", &a), ("b", &b)]);
    registered(&r1.state, 2).await;
    registered(&r2.state, 2).await;
    let prompts = traffic(&a, &b, 0, 20);
    for r in [&r1, &r2] {
        until_both(&r.state, &mut a, &mut b, &prompts[19]).await;
    }
    let mut gw = Mirror::new();
    assert_eq!(gw.pull(&r1).await[0], Took::Snapshot);
    // The stream goes on (stores, removals, a clear) while the gateway does not pull: it
    // is behind when r1 goes away, and r2 has moved on.
    a.publish_events(&[KvEvent::AllBlocksCleared]);
    let more = traffic(&a, &b, 1, 10);
    for r in [&r1, &r2] {
        until_both(&r.state, &mut a, &mut b, &more[9]).await;
    }
    converge(&r1.state, &r2.state, &prompts).await;
    r1.stop().await;
    let took = gw.pull(&r2).await;
    assert_eq!(took[0], Took::Handover, "{took:?}");
    assert!(!took.contains(&Took::Snapshot), "{took:?}");
    // What a gateway that starts on r2 now gets from its snapshot.
    let mut fresh = Mirror::new();
    assert_eq!(fresh.pull(&r2).await[0], Took::Snapshot);
    let keys: Vec<u64> = gw.seen.union(&fresh.seen).copied().collect();
    assert!(keys.len() > 40, "{} keys", keys.len());
    let differ: Vec<u64> = keys
        .iter()
        .copied()
        .filter(|&k| gw.holders(k) != fresh.holders(k))
        .collect();
    assert!(
        differ.is_empty(),
        "{} of {} keys differ",
        differ.len(),
        keys.len()
    );
    // Its next pulls are plain deltas of r2.
    let last = traffic(&a, &b, 2, 3);
    until_both(&r2.state, &mut a, &mut b, &last[2]).await;
    let took = gw.pull(&r2).await;
    assert!(took.iter().all(|t| *t == Took::Delta), "{took:?}");
    // A collector not on the stream cannot take it over: a snapshot.
    register(&direct.state, &[("a", &a), ("b", &b)]);
    let took = gw.pull(&direct).await;
    assert_eq!(took[0], Took::Snapshot, "{took:?}");
    for c in [r2, ingest, direct] {
        c.stop().await;
    }
}
