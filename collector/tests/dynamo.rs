//! The Dynamo reader (`--dynamo-namespace`, issue 23) against a real `nats-server` on a free
//! loopback port (installed by `tools/install-nats-server.sh` when absent): a publisher that
//! sends what a Dynamo worker sends on NATS Core — the event plane's msgpack envelope around a
//! msgpack `RouterEvent`, written here byte by byte from the wire facts in
//! `collector/src/bus/dynamo/wire.rs`, and the older JSON `RouterEvent` — checked through the
//! collector's `/query`: stores match, removals and clears take blocks away, a jump in event
//! ids is a gap that clears the worker, bad and oversized messages are counted and skipped,
//! workers register on their first event and the least recently heard is evicted past the cap.

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
mod natsd;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{tokens, DEADLINE};
use kvroute::api::QueryResponse;
use kvroute_collector::bus::{BusConfig, DynamoConfig, Role};
use natsd::{bus, config, Collector, Nats};
use xxhash_rust::xxh3::xxh3_64_with_seed;

const M: &str = "llama";
const BS: usize = 4;
/// Where the workers publish (`--dynamo-namespace dyn`, any component).
const SUBJECT: &str = "namespace.dyn.component.backend.kv-events";

/// A collector (role `both`, as a small Dynamo fleet's would be) reading the Dynamo subject
/// of `nats`, auto-registering at most `max_workers` Dynamo workers.
struct Reader(Collector);

impl std::ops::Deref for Reader {
    type Target = Collector;
    fn deref(&self) -> &Collector {
        &self.0
    }
}

impl Reader {
    async fn start(nats: &Nats, max_workers: usize) -> Reader {
        let dynamo = DynamoConfig {
            subject: "namespace.dyn.component.*.kv-events".into(),
            model: M.into(),
            block_size: BS as u32,
            tenant: None,
            address: "127.0.0.1:9".parse().unwrap(),
            max_message_bytes: 4096,
            max_workers,
        };
        let bus = BusConfig {
            outbox_batches: 1024,
            dynamo: Some(dynamo),
            ..bus(&nats.url(), Role::Both, "unused")
        };
        Reader(Collector::start(config(Some(bus))).await)
    }

    async fn stop(self) {
        self.0.stop().await;
    }

    /// `POST /query` over HTTP: each instance's longest match, in tokens.
    async fn query(&self, t: &[u32]) -> BTreeMap<String, u64> {
        let r: QueryResponse = reqwest::Client::new()
            .post(format!("http://{}/query", self.addr))
            .json(&serde_json::json!({"token_ids": t, "model_name": M}))
            .send()
            .await
            .expect("POST /query")
            .json()
            .await
            .expect("query JSON");
        r.instances
            .into_iter()
            .map(|(k, m)| (k, m.longest_matched))
            .collect()
    }

    /// `/query`'s whole answer for one instance: (gpu, cpu, dp ranks).
    async fn detail(&self, t: &[u32], instance: &str) -> (u64, u64, BTreeMap<String, u64>) {
        let r: QueryResponse = reqwest::Client::new()
            .post(format!("http://{}/query", self.addr))
            .json(&serde_json::json!({"token_ids": t, "model_name": M}))
            .send()
            .await
            .expect("POST /query")
            .json()
            .await
            .expect("query JSON");
        let m = &r.instances[instance];
        (m.gpu, m.cpu, m.dp.clone())
    }

    /// `kvroute_bus_messages_total{dir="dynamo",outcome}`.
    fn count(&self, outcome: &str) -> u64 {
        self.bus_count("dynamo", outcome)
    }

    /// Waits until `instance`'s longest match of `t` is `want` tokens.
    async fn until(&self, t: &[u32], instance: &str, want: u64) {
        let until = tokio::time::Instant::now() + DEADLINE;
        loop {
            let got = self.query(t).await.get(instance).copied().unwrap_or(0);
            if got == want {
                return;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "{instance} matches {got} tokens, not {want}"
            );
            let _ = self
                .state
                .wait_until(Duration::from_millis(200), |_| false)
                .await;
        }
    }
}

/// msgpack, written by hand: what `rmp_serde::to_vec_named` writes for Dynamo's types.
#[derive(Default)]
struct Mp(Vec<u8>);

impl Mp {
    fn map(&mut self, n: u8) -> &mut Self {
        self.0.push(0x80 | n);
        self
    }
    fn arr(&mut self, n: u16) -> &mut Self {
        self.0.push(0xdc);
        self.0.extend_from_slice(&n.to_be_bytes());
        self
    }
    fn s(&mut self, v: &str) -> &mut Self {
        self.0.push(0xd9);
        self.0.push(v.len() as u8);
        self.0.extend_from_slice(v.as_bytes());
        self
    }
    fn u(&mut self, v: u64) -> &mut Self {
        self.0.push(0xcf);
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn nil(&mut self) -> &mut Self {
        self.0.push(0xc0);
        self
    }
    fn bin(&mut self, v: &[u8]) -> &mut Self {
        self.0.push(0xc6);
        self.0.extend_from_slice(&(v.len() as u32).to_be_bytes());
        self.0.extend_from_slice(v);
        self
    }
}

/// `KvCacheEventData`.
enum Data<'a> {
    /// Parent's engine hash, then (engine hash, tokens) per block.
    Stored(Option<u64>, &'a [(u64, &'a [u32])]),
    Removed(&'a [u64]),
    Cleared,
}

/// Dynamo's `LocalBlockHash` of one block: xxh3-64 of its tokens as little-endian u32, seed
/// 1337 (computed here, not by kvroute's own hashing).
fn tokens_hash(block: &[u32]) -> u64 {
    let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64_with_seed(&bytes, 1337)
}

/// One `RouterEvent`, msgpack with field names.
fn router_event(worker: u64, dp: u32, event_id: u64, tier: &str, data: Data<'_>) -> Vec<u8> {
    let mut m = Mp::default();
    m.map(4).s("worker_id").u(worker);
    m.s("storage_tier").s(tier);
    m.s("residency_domain").s("worker");
    m.s("event").map(3).s("event_id").u(event_id).s("data");
    match data {
        Data::Stored(parent, blocks) => {
            m.map(1).s("stored").map(3).s("parent_hash");
            match parent {
                Some(p) => m.u(p),
                None => m.nil(),
            };
            m.s("start_position").nil();
            m.s("blocks").arr(blocks.len() as u16);
            for (engine, toks) in blocks {
                m.map(3).s("block_hash").u(*engine);
                m.s("tokens_hash").u(tokens_hash(toks));
                m.s("mm_extra_info").nil();
            }
        }
        Data::Removed(hashes) => {
            m.map(1).s("removed").map(1).s("block_hashes");
            m.arr(hashes.len() as u16);
            for h in hashes {
                m.u(*h);
            }
        }
        Data::Cleared => {
            m.s("cleared");
        }
    }
    m.s("dp_rank").u(u64::from(dp));
    m.0
}

/// The event plane's `EventEnvelope` around `payload`.
fn envelope(sequence: u64, payload: &[u8]) -> Vec<u8> {
    let mut m = Mp::default();
    m.map(5).s("publisher_id").u(0x5eed);
    m.s("sequence").u(sequence);
    m.s("published_at").u(1_764_800_000_000);
    m.s("topic").s("kv-events");
    m.s("payload").bin(payload);
    m.0
}

/// A Dynamo worker's publisher: one NATS connection, envelopes numbered in order.
struct Worker {
    client: async_nats::Client,
    sequence: u64,
}

impl Worker {
    async fn connect(nats: &Nats) -> Worker {
        Worker {
            client: async_nats::connect(nats.url()).await.expect("connect"),
            sequence: 0,
        }
    }

    async fn raw(&mut self, subject: &str, bytes: Vec<u8>) {
        self.client
            .publish(subject.to_owned(), bytes.into())
            .await
            .expect("publish");
        self.client.flush().await.expect("flush");
    }

    async fn send(&mut self, worker: u64, dp: u32, event_id: u64, tier: &str, data: Data<'_>) {
        let body = envelope(
            self.sequence,
            &router_event(worker, dp, event_id, tier, data),
        );
        self.sequence += 1;
        self.raw(SUBJECT, body).await;
    }
}

/// The blocks of `t` as (engine hash `first + i`, tokens).
fn blocks(t: &[u32], first: u64) -> Vec<(u64, &[u32])> {
    t.chunks_exact(BS)
        .enumerate()
        .map(|(i, b)| (first + i as u64, b))
        .collect()
}

/// Publishes worker `w`'s first store until the collector shows it: NATS Core drops what is
/// published before the subscription lands. Returns the next event id.
async fn first_store(c: &Reader, p: &mut Worker, w: u64, t: &[u32], first: u64) -> u64 {
    let until = tokio::time::Instant::now() + DEADLINE;
    let mut id = 0;
    loop {
        p.send(w, 0, id, "device", Data::Stored(None, &blocks(t, first)))
            .await;
        id += 1;
        let want = t.len() as u64;
        if c.state
            .wait_until(Duration::from_millis(200), |h| {
                // The model is unknown until the first registration.
                h.query_tokens(t, M, None, None, None)
                    .ok()
                    .and_then(|r| r.instances.get(&w.to_string()).map(|m| m.longest_matched))
                    == Some(want)
            })
            .await
        {
            return id;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the reader never saw worker {w}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_events_are_indexed_and_answered_by_query() {
    let nats = Nats::start().await;
    let c = Reader::start(&nats, 64).await;
    let mut p = Worker::connect(&nats).await;
    let t = tokens(1, 16);
    let mut next7 = first_store(&c, &mut p, 7, &t, 100).await;
    // Registered on its first event, under its Dynamo worker id, with the configured address.
    assert_eq!(c.query(&t).await, BTreeMap::from([("7".into(), 16)]));
    assert_eq!(c.count("registered"), 1);
    assert_eq!(
        c.state
            .read()
            .workers()
            .find(|w| w.reg.instance_id == "7")
            .and_then(|w| w.reg.address.clone()),
        Some("127.0.0.1:9".into())
    );
    assert_eq!(
        c.detail(&t, "7").await,
        (16, 16, BTreeMap::from([("0".into(), 16)]))
    );

    // Another worker, dp rank 1, holds the first two blocks in host memory.
    p.send(
        8,
        1,
        0,
        "host_pinned",
        Data::Stored(None, &blocks(&t[..8], 500)),
    )
    .await;
    c.until(&t, "8", 8).await;
    assert_eq!(
        c.detail(&t, "8").await,
        (0, 8, BTreeMap::from([("1".into(), 8)]))
    );
    // Every message so far is processed (in order on one connection): count from here.
    let applied = c.count("applied");

    // Worker 7 evicts its third block: it keeps the first two (and loses the fourth below it).
    p.send(7, 0, next7, "device", Data::Removed(&[102])).await;
    next7 += 1;
    c.until(&t, "7", 8).await;

    // Worker 8 drops its whole cache.
    p.send(8, 1, 1, "device", Data::Cleared).await;
    c.until(&t, "8", 0).await;
    assert_eq!(c.query(&t).await, BTreeMap::from([("7".into(), 8)]));

    // A second copy of an event already applied is skipped: this store would have matched.
    let t3 = tokens(300, 8);
    p.send(
        7,
        0,
        next7 - 1,
        "device",
        Data::Stored(None, &blocks(&t3, 900)),
    )
    .await;
    // A jump in worker 7's event ids: counted, its blocks cleared, the event applied.
    let t2 = tokens(200, 8);
    p.send(
        7,
        0,
        next7 + 5,
        "device",
        Data::Stored(None, &blocks(&t2, 700)),
    )
    .await;
    c.until(&t2, "7", 8).await;
    assert_eq!(c.query(&t).await.get("7"), None, "cleared on the gap");
    assert_eq!(
        c.query(&t3).await.get("7"),
        None,
        "the second copy was applied"
    );
    assert_eq!(c.count("duplicate"), 1);
    assert_eq!(c.count("gap"), 1);
    let gaps = c
        .state
        .read()
        .workers()
        .find(|w| w.reg.instance_id == "7")
        .map(|w| w.status.gaps);
    assert_eq!(gaps, Some(1));
    // And the next event after the jump is in order again: no second gap.
    p.send(
        7,
        0,
        next7 + 6,
        "device",
        Data::Stored(Some(701), &blocks(&t2[..4], 702)),
    )
    .await;
    let t2x: Vec<u32> = t2.iter().chain(&t2[..4]).copied().collect();
    c.until(&t2x, "7", 12).await;
    assert_eq!(c.count("gap"), 1);

    // The older JSON RouterEvent of Dynamo before the event plane.
    let t4 = tokens(400, 4);
    let json = format!(
        r#"{{"worker_id":11,"event":{{"event_id":0,"data":{{"stored":{{"parent_hash":null,"blocks":[{{"block_hash":1,"tokens_hash":{}}}]}}}},"dp_rank":0}}}}"#,
        tokens_hash(&t4)
    );
    p.raw(SUBJECT, json.into_bytes()).await;
    c.until(&t4, "11", 4).await;
    // The removal, the clear, the store after the gap, the next one and the JSON one.
    assert_eq!(c.count("applied") - applied, 5);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_are_counted_and_skipped() {
    let nats = Nats::start().await;
    let c = Reader::start(&nats, 64).await;
    let mut p = Worker::connect(&nats).await;
    let t = tokens(1, 8);
    let next = first_store(&c, &mut p, 7, &t, 100).await;

    // Not msgpack; JSON of another shape; an envelope whose payload is cut short.
    p.raw(SUBJECT, b"\xc1\xc1garbage".to_vec()).await;
    p.raw(SUBJECT, br#"{"worker_id":7}"#.to_vec()).await;
    let cut = router_event(7, 0, next, "device", Data::Cleared);
    p.raw(SUBJECT, envelope(99, &cut[..cut.len() - 3])).await;
    // A msgpack length that claims more than the message holds.
    p.raw(SUBJECT, b"\x81\xa5event\xdf\xff\xff\xff\xff".to_vec())
        .await;
    // Over --dynamo-max-message-bytes (4 KiB here), under the server's limit: a clear that
    // would have emptied worker 7.
    let padded = {
        let mut m = Mp::default();
        m.map(3).s("worker_id").u(7);
        m.s("pad").bin(&[0u8; 8192]);
        m.s("event")
            .map(2)
            .s("event_id")
            .u(next)
            .s("data")
            .s("cleared");
        m.0
    };
    p.raw(SUBJECT, envelope(100, &padded)).await;
    // A shared pool's event (not the worker's own cache).
    let foreign = {
        let mut m = Mp::default();
        m.map(4).s("worker_id").u(7);
        m.s("storage_tier").s("disk");
        m.s("residency_domain").s("cache_owner");
        m.s("event")
            .map(2)
            .s("event_id")
            .u(next)
            .s("data")
            .s("cleared");
        m.0
    };
    p.raw(SUBJECT, envelope(101, &foreign)).await;
    // Another namespace: not this reader's subject.
    p.raw(
        "namespace.other.component.backend.kv-events",
        envelope(102, &router_event(9, 0, 0, "device", Data::Cleared)),
    )
    .await;
    // A worker id someone registered by hand under another model: refused, its events skipped.
    c.state
        .register(kvroute::api::RegisterRequest {
            instance_id: "5".into(),
            endpoint: "tcp://127.0.0.1:1".into(),
            replay_endpoint: None,
            model_name: "other".into(),
            tenant_id: None,
            block_size: BS as u32,
            dp_rank: None,
            lora_name: None,
            cache_salt: None,
            address: None,
        })
        .expect("register by hand");
    let t5 = tokens(70, 4);
    p.send(5, 0, 0, "device", Data::Stored(None, &blocks(&t5, 600)))
        .await;
    // Then a good event, in order after all of them.
    let t2 = tokens(50, 4);
    p.send(
        7,
        0,
        next,
        "device",
        Data::Stored(Some(101), &blocks(&t2, 200)),
    )
    .await;
    let both: Vec<u32> = t.iter().chain(&t2).copied().collect();
    c.until(&both, "7", 12).await;
    assert_eq!(c.count("undecodable"), 4);
    assert_eq!(c.count("too_large"), 1);
    assert_eq!(c.count("foreign"), 1);
    assert_eq!(c.count("gap"), 0);
    assert_eq!(c.count("refused"), 1);
    assert_eq!(c.query(&t5).await.get("5"), None);
    assert!(c.state.read().workers().all(|w| w.reg.instance_id != "9"));
    // Still serving, still healthy.
    let health: serde_json::Value = reqwest::get(format!("http://{}/health", c.addr))
        .await
        .expect("GET /health")
        .json()
        .await
        .expect("health JSON");
    assert_eq!(health["status"], "ok", "{health}");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_register_on_first_sight_and_the_least_recently_heard_is_evicted() {
    let nats = Nats::start().await;
    // At most two Dynamo workers at once.
    let c = Reader::start(&nats, 2).await;
    let mut p = Worker::connect(&nats).await;
    let (ta, tb, tc) = (tokens(1, 4), tokens(10, 4), tokens(20, 4));
    let next = first_store(&c, &mut p, 1, &ta, 100).await;
    p.send(2, 0, 0, "device", Data::Stored(None, &blocks(&tb, 200)))
        .await;
    c.until(&tb, "2", 4).await;
    // Worker 1 speaks again: worker 2 is now the least recently heard.
    p.send(
        1,
        0,
        next,
        "device",
        Data::Stored(Some(100), &blocks(&tc, 150)),
    )
    .await;
    let ac: Vec<u32> = ta.iter().chain(&tc).copied().collect();
    c.until(&ac, "1", 8).await;
    // A third worker: worker 2 goes, with its blocks.
    p.send(3, 0, 0, "device", Data::Stored(None, &blocks(&tc, 300)))
        .await;
    c.until(&tc, "3", 4).await;
    assert_eq!(c.query(&tb).await.get("2"), None);
    assert_eq!(c.count("evicted"), 1);
    assert_eq!(c.count("registered"), 3);
    let mut dynamo: Vec<String> = c
        .state
        .read()
        .workers()
        .map(|w| w.reg.instance_id.clone())
        .collect();
    dynamo.sort();
    assert_eq!(dynamo, ["1", "3"]);
    // Worker 2 comes back: registered again (evicting worker 1 now), from its next event on.
    p.send(2, 0, 1, "device", Data::Stored(None, &blocks(&tb, 200)))
        .await;
    c.until(&tb, "2", 4).await;
    assert_eq!(c.count("evicted"), 2);
    assert_eq!(c.query(&ta).await.get("1"), None);
    // At the cap, a worker the hub refuses (its id registered by hand under another model)
    // evicts nobody.
    c.state
        .register(kvroute::api::RegisterRequest {
            instance_id: "5".into(),
            endpoint: "tcp://127.0.0.1:1".into(),
            replay_endpoint: None,
            model_name: "other".into(),
            tenant_id: None,
            block_size: BS as u32,
            dp_rank: None,
            lora_name: None,
            cache_salt: None,
            address: None,
        })
        .expect("register by hand");
    p.send(5, 0, 0, "device", Data::Stored(None, &blocks(&ta, 500)))
        .await;
    // In order behind it, a store of a worker already in.
    p.send(
        3,
        0,
        1,
        "device",
        Data::Stored(Some(300), &blocks(&ta, 301)),
    )
    .await;
    let ca: Vec<u32> = tc.iter().chain(&ta).copied().collect();
    c.until(&ca, "3", 8).await;
    assert_eq!(c.count("refused"), 1);
    assert_eq!(c.count("evicted"), 2);
    assert_eq!(c.query(&tb).await.get("2"), Some(&4));
    c.stop().await;
}
