//! The Dynamo reader (`--dynamo-namespace`, issue 23) against a real `nats-server` on a free
//! loopback port (installed by `tools/install-nats-server.sh` when absent): a publisher that
//! sends what a Dynamo worker sends on NATS Core — the event plane's msgpack envelope around a
//! msgpack `RouterEvent`, written here byte by byte from the wire facts in
//! `collector/src/bus/dynamo/wire.rs`, and the older JSON `RouterEvent` — checked through the
//! collector's `/query`: stores match, removals and clears take blocks away, a jump in event
//! ids is a gap that clears the worker, bad and oversized messages are counted and skipped,
//! workers register on their first event and the least recently heard is evicted past the cap.
//! Then ai-dynamo 1.6.1's own messages, byte for byte from `testdata/dynamo/`, on its subject;
//! and the KV query on a gap or a late start, answered by a stand-in for the worker's query
//! endpoint that replays the captured answers, on the NATS request plane and on the TCP one
//! (found through a file discovery record as ai-dynamo 1.6.1 writes it) (the real worker:
//! `dynamo_interop.py`).

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
mod natsd;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{tokens, DEADLINE};
use kvroute::api::QueryResponse;
use kvroute_collector::bus::{BusConfig, DynamoConfig, RecoveryConfig, Role};
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
            subjects: vec!["namespace.dyn.component.*.kv-events".into()],
            model: M.into(),
            block_size: BS as u32,
            tenant: None,
            address: "127.0.0.1:9".parse().unwrap(),
            max_message_bytes: 4096,
            max_workers,
            // No worker here answers a KV query: a gap falls back to clearing the worker.
            recovery: Some(RecoveryConfig {
                listen: None,
                timeout: Duration::from_secs(2),
                max_bytes: 1 << 20,
                discovery_dir: None,
                discovery_etcd: None,
                nats_fallback: true,
            }),
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

// --- ai-dynamo 1.6.1 as captured (testdata/dynamo/README.md) --------------------------------

/// The captured worker: Dynamo's worker id, its kv-events publisher and the subjects.
const CAP_WORKER: &str = "7030154717409816316";
const CAP_SUBJECT: &str = "namespace.dynamo.component.backend.endpoint.generate.kv-events";
const CAP_QUERY: &str = "dynamo_backend.worker_kv_query_source_3fecf4985069a-61902077d73faefc";

/// `### name` sections of a testdata/dynamo file, each one's `key: value` lines.
fn sections(file: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/dynamo")
        .join(file);
    let text = std::fs::read_to_string(&path).expect("read testdata/dynamo");
    text.split("\n### ")
        .skip(1)
        .map(|sec| {
            let mut lines = sec.lines();
            let name = lines.next().unwrap_or_default().to_owned();
            let kv = lines
                .filter_map(|l| l.split_once(": "))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            (name, kv)
        })
        .collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The captured kv-events message `n` (its index in the capture), byte for byte.
fn captured(n: usize) -> Vec<u8> {
    unhex(&sections("kv_events_1.6.1.txt")[&format!("message {n}")]["hex"])
}

/// The prompt of the capture's request `k`: 48 shared tokens, then 20 of its own (the first
/// 16 a block): 64 tokens in 4 blocks of 16.
fn cap_prompt(k: u32) -> Vec<u32> {
    (1000..1048).chain(2000 + 100 * k..2016 + 100 * k).collect()
}

/// A collector on the default subjects of namespace `dynamo`, block size 16.
async fn cap_reader(nats: &Nats, recovery: Option<RecoveryConfig>) -> Reader {
    let dynamo = DynamoConfig {
        subjects: kvroute_collector::bus::dynamo::naming::subjects("dynamo", None).unwrap(),
        model: M.into(),
        block_size: 16,
        tenant: None,
        address: "127.0.0.1:9".parse().unwrap(),
        max_message_bytes: 1 << 20,
        max_workers: 8,
        recovery,
    };
    let bus = BusConfig {
        outbox_batches: 1024,
        dynamo: Some(dynamo),
        ..bus(&nats.url(), Role::Both, "unused")
    };
    Reader(Collector::start(config(Some(bus))).await)
}

fn recovery(timeout_ms: u64, max_bytes: usize) -> Option<RecoveryConfig> {
    Some(RecoveryConfig {
        listen: None,
        timeout: Duration::from_millis(timeout_ms),
        max_bytes,
        discovery_dir: None,
        discovery_etcd: None,
        nats_fallback: true,
    })
}

/// Publishes `msg` until `c` matches `prompt` for `want` tokens (NATS Core drops what is
/// published before the subscription lands; repeats are duplicates to the reader).
async fn publish_until(c: &Reader, p: &mut Worker, msg: &[u8], prompt: &[u32], want: u64) {
    let until = tokio::time::Instant::now() + DEADLINE;
    loop {
        p.raw(CAP_SUBJECT, msg.to_vec()).await;
        let ok = c
            .state
            .wait_until(Duration::from_millis(300), |h| {
                h.query_tokens(prompt, M, None, None, None)
                    .ok()
                    .and_then(|r| r.instances.get(CAP_WORKER).map(|m| m.longest_matched))
                    == Some(want)
            })
            .await;
        if ok {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the reader never matched {want} tokens"
        );
    }
}

/// What the fake worker's KV query endpoint does with a query.
#[derive(Clone, Copy)]
enum Answering {
    /// Streams the captured answer of this name (`2_3`, `dump`, `toonew`, ...), byte for byte
    /// after a handshake naming the query.
    Captured(&'static str),
    /// Acknowledges and never connects.
    Silent,
    /// Streams a frame claiming more bytes than any budget.
    Huge,
}

/// The captured worker's KV query endpoint on the NATS request plane, as ai-dynamo 1.6.1
/// serves it; returns the queries' bodies (msgpack → JSON) as they come.
async fn fake_query_endpoint(
    nats: &Nats,
    answering: Answering,
) -> tokio::sync::mpsc::UnboundedReceiver<serde_json::Value> {
    use tokio::io::AsyncWriteExt;
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let mut sub = client.subscribe(CAP_QUERY).await.expect("subscribe");
    client.flush().await.expect("flush");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        use futures_util::StreamExt;
        while let Some(msg) = sub.next().await {
            let b = &msg.payload;
            let hl = u64::from_be_bytes(b[..8].try_into().unwrap()) as usize;
            let header: serde_json::Value = serde_json::from_slice(&b[24..24 + hl]).unwrap();
            let info: serde_json::Value =
                serde_json::from_str(header["connection_info"]["info"].as_str().unwrap()).unwrap();
            let _ = tx.send(msgpack_json(&b[24 + hl..]));
            client
                .publish(msg.reply.unwrap(), bytes::Bytes::new())
                .await
                .unwrap();
            let name = match answering {
                Answering::Silent => continue,
                Answering::Captured(name) => name,
                Answering::Huge => "",
            };
            let mut s = tokio::net::TcpStream::connect(info["address"].as_str().unwrap())
                .await
                .unwrap();
            let hs = serde_json::json!({"subject": info["subject"], "stream_type": "response"});
            s.write_all(&two_part(hs.to_string().as_bytes(), b""))
                .await
                .unwrap();
            if name.is_empty() {
                let mut f = two_part(b"", b"");
                f[8..16].copy_from_slice(&(u64::MAX / 2).to_be_bytes());
                let _ = s.write_all(&f).await;
            } else {
                // The captured stream after its own handshake frame.
                let stream = unhex(&sections("worker_kv_query_1.6.1.txt")[name]["stream"]);
                let hl = u64::from_be_bytes(stream[..8].try_into().unwrap()) as usize;
                s.write_all(&stream[24 + hl..]).await.unwrap();
            }
            let _ = s.flush().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    rx
}

fn two_part(header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&(header.len() as u64).to_be_bytes());
    f.extend_from_slice(&(body.len() as u64).to_be_bytes());
    f.extend_from_slice(&0u64.to_be_bytes());
    f.extend_from_slice(header);
    f.extend_from_slice(body);
    f
}

/// The flat msgpack map of a query body as JSON (uints, nil, bools, short strings).
fn msgpack_json(b: &[u8]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    let n = usize::from(b[0] & 0x0f);
    let mut i = 1;
    let value = |i: &mut usize| -> serde_json::Value {
        let t = b[*i];
        *i += 1;
        let be = |i: &mut usize, n: usize| {
            let v = b[*i..*i + n]
                .iter()
                .fold(0u64, |a, &x| (a << 8) | u64::from(x));
            *i += n;
            v
        };
        match t {
            0x00..=0x7f => u64::from(t).into(),
            0xcc => be(i, 1).into(),
            0xcd => be(i, 2).into(),
            0xce => be(i, 4).into(),
            0xcf => be(i, 8).into(),
            0xc0 => serde_json::Value::Null,
            0xc2 => false.into(),
            0xc3 => true.into(),
            0xa0..=0xbf => {
                let len = usize::from(t & 0x1f);
                *i += len;
                String::from_utf8_lossy(&b[*i - len..*i]).into()
            }
            _ => panic!("unexpected msgpack {t:#x}"),
        }
    };
    for _ in 0..n {
        let k = value(&mut i);
        let v = value(&mut i);
        out.insert(k.as_str().unwrap().to_owned(), v);
    }
    serde_json::Value::Object(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ai_dynamo_1_6_1_messages_are_indexed_on_the_default_subject() {
    let nats = Nats::start().await;
    let c = cap_reader(&nats, None).await;
    let mut p = Worker::connect(&nats).await;
    // Events 1, 2 and 3 of the captured worker: request 0's four blocks, then one block of
    // requests 1 and 2 each below its first three.
    publish_until(&c, &mut p, &captured(0), &cap_prompt(0), 64).await;
    p.raw(CAP_SUBJECT, captured(1)).await;
    p.raw(CAP_SUBJECT, captured(2)).await;
    c.until(&cap_prompt(2), CAP_WORKER, 64).await;
    c.until(&cap_prompt(1), CAP_WORKER, 64).await;
    assert_eq!(c.count("undecodable"), 0);
    // Message 17 holds two events (18: a removal, 19: a store): a jump from 3, so with
    // --dynamo-recovery off the worker's blocks are cleared, then both are applied.
    p.raw(CAP_SUBJECT, captured(17)).await;
    c.until(&cap_prompt(0), CAP_WORKER, 0).await;
    assert_eq!(c.count("gap"), 1);
    // Events 1, 2, 3, 18 and 19 (repeats of event 1 are duplicates).
    assert_eq!(c.count("applied"), 5);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_by_the_workers_kv_query() {
    let nats = Nats::start().await;
    let mut queries = fake_query_endpoint(&nats, Answering::Captured("2_3")).await;
    let c = cap_reader(&nats, recovery(3000, 1 << 20)).await;
    let mut p = Worker::connect(&nats).await;
    publish_until(&c, &mut p, &captured(0), &cap_prompt(0), 64).await;
    // Event 3 without event 2: the reader asks for 2..2 and the worker's answer (events 2
    // and 3, as captured) fills it; no block is cleared.
    p.raw(CAP_SUBJECT, captured(2)).await;
    c.until(&cap_prompt(1), CAP_WORKER, 64).await;
    c.until(&cap_prompt(2), CAP_WORKER, 64).await;
    let q = queries.recv().await.expect("a query");
    assert_eq!(
        q,
        serde_json::json!({"worker_id": 7030154717409816316u64, "dp_rank": 0,
            "start_event_id": 2, "end_event_id": 2, "supports_tree_dump_failed": true,
            "kind": "recovery"})
    );
    assert_eq!(c.count("gap"), 1);
    assert_eq!(c.bus_count("dynamo_recovery", "recovered"), 1);
    assert_eq!(c.query(&cap_prompt(0)).await.get(CAP_WORKER), Some(&64));
    let gaps = c
        .state
        .read()
        .workers()
        .find(|w| w.reg.instance_id == CAP_WORKER)
        .map(|w| w.status.gaps);
    assert_eq!(gaps, Some(0), "nothing cleared");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_collector_takes_the_workers_tree_dump() {
    let nats = Nats::start().await;
    let mut queries = fake_query_endpoint(&nats, Answering::Captured("dump")).await;
    let c = cap_reader(&nats, recovery(3000, 1 << 20)).await;
    let mut p = Worker::connect(&nats).await;
    // The first event this collector hears is event 3: it asks for the whole cache, whose
    // dump (as of event 3) brings requests 0 and 1 it never heard of.
    publish_until(&c, &mut p, &captured(2), &cap_prompt(0), 64).await;
    c.until(&cap_prompt(1), CAP_WORKER, 64).await;
    c.until(&cap_prompt(2), CAP_WORKER, 64).await;
    let q = queries.recv().await.expect("a query");
    assert_eq!(q["start_event_id"], serde_json::Value::Null);
    assert_eq!(q["end_event_id"], serde_json::Value::Null);
    assert_eq!(c.bus_count("dynamo_recovery", "dumped"), 1);
    assert_eq!(c.count("gap"), 0);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_queries_fall_back_to_clearing_the_worker() {
    for (answering, outcome) in [
        (Answering::Captured("toonew"), "refused"),
        (Answering::Captured("otherworker"), "refused"),
        (Answering::Silent, "timeout"),
        (Answering::Huge, "bad_answer"),
    ] {
        let nats = Nats::start().await;
        let _queries = fake_query_endpoint(&nats, answering).await;
        let c = cap_reader(&nats, recovery(500, 64 << 10)).await;
        let mut p = Worker::connect(&nats).await;
        publish_until(&c, &mut p, &captured(0), &cap_prompt(0), 64).await;
        // Events 18 and 19 after 1: the query fails, request 0's blocks are cleared.
        p.raw(CAP_SUBJECT, captured(17)).await;
        c.until(&cap_prompt(0), CAP_WORKER, 0).await;
        assert_eq!(c.bus_count("dynamo_recovery", outcome), 1, "{outcome}");
        assert_eq!(c.count("gap"), 1);
        let gaps = c
            .state
            .read()
            .workers()
            .find(|w| w.reg.instance_id == CAP_WORKER)
            .map(|w| w.status.gaps);
        assert_eq!(gaps, Some(1), "{outcome}");
        c.stop().await;
    }
    // No responder at all (a worker on the TCP request plane): unreachable, the same fallback.
    let nats = Nats::start().await;
    let c = cap_reader(&nats, recovery(3000, 1 << 20)).await;
    let mut p = Worker::connect(&nats).await;
    publish_until(&c, &mut p, &captured(0), &cap_prompt(0), 64).await;
    p.raw(CAP_SUBJECT, captured(17)).await;
    c.until(&cap_prompt(0), CAP_WORKER, 0).await;
    assert_eq!(c.bus_count("dynamo_recovery", "unreachable"), 1);
    c.stop().await;
}

/// The captured worker's KV query endpoint as Dynamo names it.
fn cap_endpoint() -> kvroute_collector::bus::dynamo::naming::QueryEndpoint {
    kvroute_collector::bus::dynamo::naming::query_endpoint(
        CAP_SUBJECT,
        0x3fecf4985069a,
        CAP_WORKER.parse().unwrap(),
    )
    .unwrap()
}

/// A file discovery root (`DYN_FILE_KV`) holding `record` as the captured worker's KV query
/// endpoint, or nothing.
fn discovery_root(record: Option<&str>) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let root = std::env::temp_dir().join(format!(
        "kvroute-dynamo-discovery-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let dir = root.join("v1/instances");
    std::fs::create_dir_all(&dir).unwrap();
    if let Some(r) = record {
        std::fs::write(dir.join(cap_endpoint().discovery_file()), r).unwrap();
    }
    root
}

/// The record ai-dynamo 1.6.1 writes for the captured worker's endpoint, at `addr`.
fn tcp_record(addr: std::net::SocketAddr) -> String {
    let e = cap_endpoint();
    serde_json::json!({"type": "Endpoint", "component": e.component, "endpoint": e.endpoint,
        "namespace": e.namespace, "instance_id": e.worker_id,
        "transport": {"tcp": format!("{addr}/{TCP_PATH}")},
        "device_type": "cuda", "request_plane_codec": "msgpack"})
    .to_string()
}

/// The endpoint path the fake TCP worker serves (1.6.1: `<instance hex>/<ns>/<c>/<endpoint>`).
const TCP_PATH: &str = "61902077d73faefc/dynamo/backend/worker_kv_query_source_3fecf4985069a";

/// The captured worker's KV query endpoint on the TCP request plane: reads each request
/// message as ai-dynamo 1.6.1's worker does, acknowledges it (empty, or the worker's error
/// for a path it does not serve), then streams the captured answer `answer` to the listener
/// the request names. Returns its address and each query's (path, body).
async fn fake_tcp_worker(
    answer: &'static str,
) -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<(String, serde_json::Value)>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let mut n2 = [0u8; 2];
            s.read_exact(&mut n2).await.unwrap();
            let mut path = vec![0; usize::from(u16::from_be_bytes(n2))];
            s.read_exact(&mut path).await.unwrap();
            s.read_exact(&mut n2).await.unwrap();
            let mut headers = vec![0; usize::from(u16::from_be_bytes(n2))];
            s.read_exact(&mut headers).await.unwrap();
            let headers: BTreeMap<String, String> = serde_json::from_slice(&headers).unwrap();
            let mut n4 = [0u8; 4];
            s.read_exact(&mut n4).await.unwrap();
            let mut b = vec![0; u32::from_be_bytes(n4) as usize];
            s.read_exact(&mut b).await.unwrap();
            let path = String::from_utf8(path).unwrap();
            assert_eq!(headers["x-endpoint-path"], path);
            let hl = u64::from_be_bytes(b[..8].try_into().unwrap()) as usize;
            let header: serde_json::Value = serde_json::from_slice(&b[24..24 + hl]).unwrap();
            assert_eq!(headers["request-id"], header["id"]);
            let info: serde_json::Value =
                serde_json::from_str(header["connection_info"]["info"].as_str().unwrap()).unwrap();
            let _ = tx.send((path.clone(), msgpack_json(&b[24 + hl..])));
            if path != TCP_PATH {
                let text = format!("Server unavailable: unknown endpoint {path}");
                let mut ack = (text.len() as u32).to_be_bytes().to_vec();
                ack.extend_from_slice(text.as_bytes());
                s.write_all(&ack).await.unwrap();
                continue;
            }
            s.write_all(&[0, 0, 0, 0]).await.unwrap();
            drop(s);
            let mut r = tokio::net::TcpStream::connect(info["address"].as_str().unwrap())
                .await
                .unwrap();
            let hs = serde_json::json!({"subject": info["subject"], "stream_type": "response"});
            r.write_all(&two_part(hs.to_string().as_bytes(), b""))
                .await
                .unwrap();
            // The answer streams back as on the NATS plane: the captured one after its
            // own handshake frame.
            let stream = unhex(&sections("worker_kv_query_1.6.1.txt")[answer]["stream"]);
            let hl = u64::from_be_bytes(stream[..8].try_into().unwrap()) as usize;
            r.write_all(&stream[24 + hl..]).await.unwrap();
            let _ = r.flush().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (addr, rx)
}

/// `--dynamo-recovery tcp` (or `nats`, `nats_fallback`) with `root` as the discovery root.
fn tcp_recovery(root: &std::path::Path, nats_fallback: bool) -> Option<RecoveryConfig> {
    Some(RecoveryConfig {
        listen: None,
        // Generous: debug builds of parallel tests on a small machine.
        timeout: Duration::from_secs(5),
        max_bytes: 1 << 20,
        discovery_dir: Some(root.to_owned()),
        discovery_etcd: None,
        nats_fallback,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_over_the_tcp_request_plane_found_in_file_discovery() {
    let nats = Nats::start().await;
    let (addr, mut queries) = fake_tcp_worker("2_3").await;
    let root = discovery_root(Some(&tcp_record(addr)));
    let c = cap_reader(&nats, tcp_recovery(&root, false)).await;
    let mut p = Worker::connect(&nats).await;
    publish_until(&c, &mut p, &captured(0), &cap_prompt(0), 64).await;
    // Event 3 without event 2: asked over TCP at the address the record names.
    p.raw(CAP_SUBJECT, captured(2)).await;
    c.until(&cap_prompt(1), CAP_WORKER, 64).await;
    c.until(&cap_prompt(2), CAP_WORKER, 64).await;
    let (path, q) = queries.recv().await.expect("a query over TCP");
    assert_eq!(path, TCP_PATH);
    assert_eq!(
        q,
        serde_json::json!({"worker_id": 7030154717409816316u64, "dp_rank": 0,
            "start_event_id": 2, "end_event_id": 2, "supports_tree_dump_failed": true,
            "kind": "recovery"})
    );
    assert_eq!(c.bus_count("dynamo_recovery", "recovered"), 1);
    assert_eq!(c.bus_count("dynamo_discovery", "tcp"), 1);
    assert_eq!(c.query(&cap_prompt(0)).await.get(CAP_WORKER), Some(&64));
    let gaps = c
        .state
        .read()
        .workers()
        .find(|w| w.reg.instance_id == CAP_WORKER)
        .map(|w| w.status.gaps);
    assert_eq!(gaps, Some(0), "nothing cleared");
    c.stop().await;
    let _ = std::fs::remove_dir_all(root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_collector_takes_the_tree_dump_over_tcp() {
    let nats = Nats::start().await;
    let (addr, mut queries) = fake_tcp_worker("dump").await;
    let root = discovery_root(Some(&tcp_record(addr)));
    // `nats` with a discovery root: the record says TCP, so TCP it is.
    let c = cap_reader(&nats, tcp_recovery(&root, true)).await;
    let mut p = Worker::connect(&nats).await;
    publish_until(&c, &mut p, &captured(2), &cap_prompt(0), 64).await;
    c.until(&cap_prompt(1), CAP_WORKER, 64).await;
    let (_, q) = queries.recv().await.expect("a query over TCP");
    assert_eq!(q["start_event_id"], serde_json::Value::Null);
    assert_eq!(c.bus_count("dynamo_recovery", "dumped"), 1);
    assert_eq!(c.bus_count("dynamo_discovery", "tcp"), 1);
    c.stop().await;
    let _ = std::fs::remove_dir_all(root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_queries_that_cannot_be_made_fall_back_to_clearing_the_worker() {
    let (addr, mut queries) = fake_tcp_worker("2_3").await;
    // Nothing listens there once this listener is gone.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let wrong_path = tcp_record(addr).replace(TCP_PATH, "elsewhere");
    for (record, discovery, outcome) in [
        (None, "missing", "unreachable"),
        (
            Some("{\"type\": \"Endpoint\"".to_owned()),
            "malformed",
            "unreachable",
        ),
        (Some(tcp_record(dead)), "tcp", "unreachable"),
        (Some(wrong_path), "tcp", "unreachable"),
        // Over the budget: the worker's error text is bigger than what is left.
        (
            Some(tcp_record(addr).replace(TCP_PATH, &"x".repeat(400))),
            "tcp",
            "bad_answer",
        ),
    ] {
        let nats = Nats::start().await;
        let root = discovery_root(record.as_deref());
        let mut rc = tcp_recovery(&root, false);
        if outcome == "bad_answer" {
            rc.as_mut().unwrap().max_bytes = 256;
        }
        let c = cap_reader(&nats, rc).await;
        let mut p = Worker::connect(&nats).await;
        publish_until(&c, &mut p, &captured(0), &cap_prompt(0), 64).await;
        p.raw(CAP_SUBJECT, captured(17)).await;
        c.until(&cap_prompt(0), CAP_WORKER, 0).await;
        assert_eq!(c.bus_count("dynamo_discovery", discovery), 1, "{discovery}");
        assert_eq!(
            c.bus_count("dynamo_recovery", outcome),
            1,
            "{discovery} {outcome}"
        );
        assert_eq!(c.count("gap"), 1);
        c.stop().await;
        let _ = std::fs::remove_dir_all(root);
    }
    // The wrong path and the oversized one reached the worker, which refused them.
    assert_eq!(queries.recv().await.map(|q| q.0), Some("elsewhere".into()));
    assert_eq!(queries.recv().await.map(|q| q.0.len()), Some(400));
    // `nats`: a worker discovery does not know is asked over NATS as before.
    let nats = Nats::start().await;
    let mut nats_queries = fake_query_endpoint(&nats, Answering::Captured("2_3")).await;
    let root = discovery_root(None);
    let c = cap_reader(&nats, tcp_recovery(&root, true)).await;
    let mut p = Worker::connect(&nats).await;
    publish_until(&c, &mut p, &captured(0), &cap_prompt(0), 64).await;
    p.raw(CAP_SUBJECT, captured(2)).await;
    c.until(&cap_prompt(2), CAP_WORKER, 64).await;
    assert!(nats_queries.recv().await.is_some());
    assert_eq!(c.bus_count("dynamo_discovery", "missing"), 1);
    assert_eq!(c.bus_count("dynamo_recovery", "recovered"), 1);
    c.stop().await;
    let _ = std::fs::remove_dir_all(root);
}

/// A stand-in for etcd's JSON gateway holding `record` (or nothing) under the captured
/// worker's key, answering `POST /v3/kv/range` as etcd 3.4 does
/// (`testdata/dynamo/etcd_discovery_1.6.1.txt`). Returns its URL and each range request's key.
async fn fake_etcd(
    record: Option<String>,
) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
    use kvroute_collector::bus::dynamo::etcd;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let mut req = Vec::new();
            let mut buf = [0u8; 4096];
            let body = loop {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "a whole request");
                req.extend_from_slice(&buf[..n]);
                let text = String::from_utf8(req.clone()).unwrap();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    assert!(head.starts_with("POST /v3/kv/range HTTP/1.1\r\n"), "{head}");
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length: ")
                                .map(|n| n.trim().parse().unwrap())
                        })
                        .unwrap();
                    if body.len() >= len {
                        break body.to_owned();
                    }
                }
            };
            let asked: serde_json::Value = serde_json::from_str(&body).unwrap();
            let key = etcd::base64_decode(asked["key"].as_str().unwrap()).unwrap();
            let key = String::from_utf8(key).unwrap();
            let mut answer = serde_json::json!({"header": {"cluster_id": "1", "member_id": "2",
                "revision": "9", "raft_term": "2"}});
            if let Some(r) = record
                .as_ref()
                .filter(|_| key == etcd::key(&cap_endpoint()))
            {
                answer["kvs"] = serde_json::json!([{"key": etcd::base64_encode(key.as_bytes()),
                    "create_revision": "8", "mod_revision": "8", "version": "1",
                    "value": etcd::base64_encode(r.as_bytes()), "lease": "7"}]);
                answer["count"] = "1".into();
            }
            let _ = tx.send(key);
            let body = answer.to_string();
            let head = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len());
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(body.as_bytes()).await;
        }
    });
    (url, rx)
}

/// `--dynamo-recovery tcp` (or `nats`, `nats_fallback`) with etcd discovery at `url`.
fn etcd_recovery(url: &str, nats_fallback: bool) -> Option<RecoveryConfig> {
    Some(RecoveryConfig {
        listen: None,
        timeout: Duration::from_secs(5),
        max_bytes: 1 << 20,
        discovery_dir: None,
        discovery_etcd: Some(url.to_owned()),
        nats_fallback,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_collector_finds_the_worker_in_etcd_discovery() {
    let nats = Nats::start().await;
    let (addr, mut queries) = fake_tcp_worker("dump").await;
    let (url, mut keys) = fake_etcd(Some(tcp_record(addr))).await;
    let c = cap_reader(&nats, etcd_recovery(&url, false)).await;
    let mut p = Worker::connect(&nats).await;
    publish_until(&c, &mut p, &captured(2), &cap_prompt(0), 64).await;
    c.until(&cap_prompt(1), CAP_WORKER, 64).await;
    assert_eq!(
        keys.recv().await.as_deref(),
        Some("v1/instances/dynamo/backend/worker_kv_query_source_3fecf4985069a/61902077d73faefc")
    );
    let (path, q) = queries.recv().await.expect("a query over TCP");
    assert_eq!(path, TCP_PATH);
    assert_eq!(q["start_event_id"], serde_json::Value::Null);
    assert_eq!(c.bus_count("dynamo_recovery", "dumped"), 1);
    assert_eq!(c.bus_count("dynamo_discovery", "tcp"), 1);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_lookups_that_fail_fall_back_as_file_ones_do() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    // No such key, an etcd that holds garbage, no etcd: with `tcp`, the worker is cleared.
    for (etcd, discovery) in [
        (Some(None), "missing"),
        (
            Some(Some("{\"type\": \"Endpoint\"".to_owned())),
            "malformed",
        ),
        (None, "malformed"),
    ] {
        let nats = Nats::start().await;
        let url = match etcd {
            Some(record) => fake_etcd(record).await.0,
            None => dead.clone(),
        };
        let c = cap_reader(&nats, etcd_recovery(&url, false)).await;
        let mut p = Worker::connect(&nats).await;
        publish_until(&c, &mut p, &captured(0), &cap_prompt(0), 64).await;
        p.raw(CAP_SUBJECT, captured(17)).await;
        c.until(&cap_prompt(0), CAP_WORKER, 0).await;
        assert_eq!(c.bus_count("dynamo_discovery", discovery), 1, "{discovery}");
        assert_eq!(
            c.bus_count("dynamo_recovery", "unreachable"),
            1,
            "{discovery}"
        );
        assert_eq!(c.count("gap"), 1);
        c.stop().await;
    }
    // `nats`: no etcd there, so the worker is asked over NATS as before.
    let nats = Nats::start().await;
    let mut nats_queries = fake_query_endpoint(&nats, Answering::Captured("2_3")).await;
    let c = cap_reader(&nats, etcd_recovery(&dead, true)).await;
    let mut p = Worker::connect(&nats).await;
    publish_until(&c, &mut p, &captured(0), &cap_prompt(0), 64).await;
    p.raw(CAP_SUBJECT, captured(2)).await;
    c.until(&cap_prompt(2), CAP_WORKER, 64).await;
    assert!(nats_queries.recv().await.is_some());
    assert_eq!(c.bus_count("dynamo_discovery", "malformed"), 1);
    assert_eq!(c.bus_count("dynamo_recovery", "recovered"), 1);
    c.stop().await;
}
