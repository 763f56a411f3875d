//! The event stream an engine publishes, received over ZMQ and decoded by the collector's
//! decoder (`kvroute_collector::decode`), equals exactly the changes its cache made; replay
//! returns exactly what was published, in the reply shape of the engine version.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bytes::Bytes;
use kvroute::event::{EngineHash, KvEvent, Tier};
use kvroute_sim::cache::{CacheConfig, CacheEvent};
use kvroute_sim::engine::{Engine, EngineConfig};
use kvroute_sim::wire::EventFormat;

/// One atomic change: a stored block (with its parent), a removed block, or a clear.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Change {
    Stored {
        parent: Option<EngineHash>,
        hash: EngineHash,
        tokens: Vec<u32>,
    },
    Removed(EngineHash),
    Cleared,
}

fn flatten_cache(events: &[CacheEvent], bs: usize) -> Vec<Change> {
    let mut out = Vec::new();
    for e in events {
        match e {
            CacheEvent::BlockStored {
                parent,
                hashes,
                token_ids,
            } => {
                let mut p = *parent;
                for (h, toks) in hashes.iter().zip(token_ids.chunks(bs)) {
                    out.push(Change::Stored {
                        parent: p,
                        hash: *h,
                        tokens: toks.to_vec(),
                    });
                    p = Some(*h);
                }
            }
            CacheEvent::BlockRemoved { hash } => out.push(Change::Removed(*hash)),
            CacheEvent::AllBlocksCleared => out.push(Change::Cleared),
        }
    }
    out
}

fn flatten_decoded(events: &[KvEvent]) -> Vec<Change> {
    let mut out = Vec::new();
    for e in events {
        match e {
            KvEvent::BlockStored {
                parent,
                blocks,
                tier,
                lora_name,
                cache_salt,
            } => {
                assert_eq!(*tier, Tier::Gpu);
                assert!(lora_name.is_none() && cache_salt.is_none());
                let mut p = *parent;
                for b in blocks {
                    out.push(Change::Stored {
                        parent: p,
                        hash: b.hash,
                        tokens: b.tokens.clone(),
                    });
                    p = Some(b.hash);
                }
            }
            KvEvent::BlockRemoved { hashes, tier } => {
                assert_eq!(*tier, Tier::Gpu);
                out.extend(hashes.iter().map(|h| Change::Removed(*h)));
            }
            KvEvent::AllBlocksCleared => out.push(Change::Cleared),
        }
    }
    out
}

async fn engine(format: EventFormat, endpoint: &str, dp_size: u32) -> Engine {
    Engine::start(EngineConfig {
        name: "e0".into(),
        cache: CacheConfig {
            block_size_tokens: 4,
            capacity_blocks: 24,
        },
        speed: 1000.0,
        dp_size,
        event_format: format,
        events_endpoint: Some(endpoint.to_string()),
        replay_endpoint: Some(endpoint.to_string()),
        topic: "kv@e0@sim-model".into(),
        journal: true,
        // Steps of 3 blocks: long admissions go out as several batches, as vLLM's do.
        max_batched_tokens: 12,
        ..EngineConfig::default()
    })
    .await
    .expect("engine starts")
}

/// Prompts from a few families that share prefixes, long enough to force evictions.
fn prompt(i: u32) -> Vec<u32> {
    let family = i % 3;
    let len = 9 + (i * 7) % 23;
    (0..len)
        .map(|k| {
            if k < 12 {
                family * 1000 + k
            } else {
                i * 100 + k
            }
        })
        .collect()
}

/// A request admitted and finished at once (the journal records its cache changes).
async fn touch(e: &Engine, p: Vec<u32>, rank: Option<u32>) {
    let run = e.submit(p, 1, rank).await.expect("admitted");
    drop(run);
}

// The test side uses blocking libzmq sockets with receive timeouts: the engine runs on the
// runtime's workers and its publisher on threads of its own, not on the test body's thread.

/// A socket of the test's own context, closed at once when dropped.
fn socket(kind: zmq::SocketType, endpoint: &str) -> zmq::Socket {
    let s = zmq::Context::new().socket(kind).expect("socket");
    s.set_linger(0).unwrap();
    s.connect(endpoint).expect("connect");
    s
}

/// The next message's frames, or `None` after `wait`.
fn recv_timeout(s: &zmq::Socket, wait: Duration) -> Option<Vec<Bytes>> {
    let ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
    s.set_rcvtimeo(ms).unwrap();
    s.recv_multipart(0)
        .ok()
        .map(|frames| frames.into_iter().map(Bytes::from).collect())
}

fn seq_of(frames: &[Bytes]) -> u64 {
    u64::from_be_bytes(frames[1].as_ref().try_into().unwrap())
}

/// Subscribes and publishes probe batches until one arrives, so later batches are not lost to
/// the slow-joiner race (bounded number of probes).
async fn subscribe(e: &Engine, rank: u32) -> (zmq::Socket, Vec<Vec<Bytes>>) {
    let (ep, _) = e.event_endpoints()[rank as usize].clone();
    let sub = socket(zmq::SUB, &ep);
    sub.set_subscribe(b"").expect("subscribe");
    for i in 0..200u32 {
        touch(e, vec![90_000 + i; 5], Some(rank)).await;
        if let Some(m) = recv_timeout(&sub, Duration::from_millis(200)) {
            return (sub, vec![m]);
        }
    }
    panic!("no batch arrived after 200 probes");
}

fn replay(replay_ep: &str, start: u64) -> Vec<Vec<Bytes>> {
    let dealer = socket(zmq::DEALER, replay_ep);
    dealer
        .send_multipart([&[][..], &start.to_be_bytes()[..]], 0)
        .expect("send replay request");
    let mut out = Vec::new();
    loop {
        let frames = recv_timeout(&dealer, Duration::from_secs(10)).expect("replay reply in time");
        let end = frames.iter().any(|f| f.as_ref() == [0xff; 8]);
        out.push(frames);
        if end {
            return out;
        }
    }
}

async fn check_stream(format: EventFormat) {
    let e = engine(format, "tcp://127.0.0.1:0", 1).await;
    let (sub, mut live) = subscribe(&e, 0).await;
    for i in 0..40 {
        touch(&e, prompt(i), None).await;
    }
    assert!(e.reset_prefix_cache());
    touch(&e, prompt(1), None).await;
    let last = e.journal(0).len() as u64 - 1;
    let mut published = e.publisher(0).unwrap().published();
    published.wait_for(|s| *s == Some(last)).await.unwrap();
    // Live messages until the last seq (the PUB queue delivers in order).
    loop {
        if live.last().map(|m| seq_of(m)) == Some(last) {
            break;
        }
        let m = recv_timeout(&sub, Duration::from_secs(10)).expect("live batch");
        live.push(m);
    }
    let mut payloads: BTreeMap<u64, Bytes> = BTreeMap::new();
    for f in &live {
        assert_eq!(f.len(), 3, "[topic, seq, payload]");
        assert_eq!(f[0].as_ref(), b"kv@e0@sim-model");
        payloads.insert(seq_of(f), f[2].clone());
    }
    // Replay everything from seq 0: the early batches the subscription missed, and the rest
    // exactly as they went out live.
    let (_, replay_ep) = e.event_endpoints()[0].clone();
    let replies = replay(&replay_ep.unwrap(), 0);
    let (end, batches) = replies.split_last().unwrap();
    if format == EventFormat::Vllm023 {
        assert_eq!(
            end,
            &vec![Bytes::new(), Bytes::from_static(&[0xff; 8]), Bytes::new()]
        );
    } else {
        assert_eq!(
            end,
            &vec![
                Bytes::new(),
                Bytes::new(),
                Bytes::from_static(&[0xff; 8]),
                Bytes::new()
            ]
        );
    }
    assert_eq!(batches.len() as u64, last + 1);
    for (i, f) in batches.iter().enumerate() {
        let (seq, payload) = if format == EventFormat::Vllm023 {
            assert_eq!(f.len(), 3, "[\"\", seq, payload]");
            (&f[1], &f[2])
        } else {
            assert_eq!(f.len(), 4, "[\"\", topic, seq, payload]");
            assert_eq!(f[1].as_ref(), b"kv@e0@sim-model");
            (&f[2], &f[3])
        };
        assert!(f[0].is_empty());
        let seq = u64::from_be_bytes(seq.as_ref().try_into().unwrap());
        assert_eq!(seq, i as u64);
        match payloads.get(&seq) {
            Some(p) => assert_eq!(p, payload, "replay returns what was published"),
            None => {
                payloads.insert(seq, payload.clone());
            }
        }
    }
    // Decoded by the collector, every batch is exactly the cache's changes.
    let journal = e.journal(0);
    let mut cached: BTreeSet<EngineHash> = BTreeSet::new();
    let mut removals = 0;
    for (seq, payload) in &payloads {
        let batch =
            kvroute_collector::decode::decode(payload).expect("collector decodes the batch");
        assert_eq!(batch.dp_rank, Some(0));
        let got = flatten_decoded(&batch.events);
        assert_eq!(
            got,
            flatten_cache(&journal[*seq as usize], 4),
            "batch {seq} ({format})"
        );
        for c in got {
            match c {
                Change::Stored { hash, .. } => {
                    cached.insert(hash);
                }
                Change::Removed(h) => {
                    removals += 1;
                    assert!(cached.remove(&h), "removed block {h:?} was stored");
                }
                Change::Cleared => cached.clear(),
            }
        }
    }
    assert!(removals > 10, "the workload evicts");
    assert_eq!(
        cached.into_iter().collect::<Vec<_>>(),
        e.cached_hashes(0),
        "the stream folds to the cache's contents"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_033_stream_decodes_to_the_cache_changes() {
    check_stream(EventFormat::Vllm033).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_023_stream_decodes_to_the_cache_changes() {
    check_stream(EventFormat::Vllm023).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_stream_decodes_to_the_cache_changes() {
    check_stream(EventFormat::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_ranks_publish_on_offset_ports_with_their_rank() {
    // A free port pair: bind two consecutive ports would race; take one from the OS and use
    // it and the next (retried on the rare collision).
    let mut started = None;
    for _ in 0..20 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if port >= 65000 {
            continue;
        }
        let ep = format!("tcp://127.0.0.1:{port}");
        let r = Engine::start(EngineConfig {
            cache: CacheConfig {
                block_size_tokens: 4,
                capacity_blocks: 24,
            },
            dp_size: 2,
            events_endpoint: Some(ep),
            journal: true,
            ..EngineConfig::default()
        })
        .await;
        if let Ok(e) = r {
            started = Some((e, port));
            break;
        }
    }
    let (e, port) = started.expect("a free port pair");
    let eps = e.event_endpoints();
    assert_eq!(eps[0].0, format!("tcp://127.0.0.1:{port}"));
    assert_eq!(eps[1].0, format!("tcp://127.0.0.1:{}", port + 1));
    let (sub, first) = subscribe(&e, 1).await;
    let batch = kvroute_collector::decode::decode(&first[0][2]).unwrap();
    assert_eq!(batch.dp_rank, Some(1));
    touch(&e, vec![7; 9], Some(1)).await;
    let m = recv_timeout(&sub, Duration::from_secs(10)).expect("rank 1 batch");
    let batch = kvroute_collector::decode::decode(&m[2]).unwrap();
    assert_eq!(batch.dp_rank, Some(1));
    assert!(e.journal(0).is_empty(), "rank 0 saw nothing");
}

/// A LoRA, salted, CPU-tier store, a DISK removal and a clear.
fn scoped_events() -> Vec<KvEvent> {
    let mut ev = kvroute_sim::wire::stored(None, 1 << 63, &[1, 2, 3, 4, 5, 6, 7, 8], 4);
    if let KvEvent::BlockStored {
        cache_salt,
        lora_name,
        tier,
        ..
    } = &mut ev
    {
        *cache_salt = Some("salt".into());
        *lora_name = Some("lora".into());
        *tier = Tier::Cpu;
    }
    vec![
        ev,
        KvEvent::BlockRemoved {
            hashes: vec![EngineHash(1 << 63)],
            tier: Tier::Disk,
        },
        KvEvent::AllBlocksCleared,
    ]
}

#[test]
fn core_events_decode_back_in_every_format() {
    use kvroute_sim::wire::{encode_events, Extras};
    let events = scoped_events();
    // vLLM carries the LoRA name and the salt, with or without the optional group fields.
    for format in [EventFormat::Vllm033, EventFormat::Vllm023] {
        for group in [false, true] {
            let x = Extras {
                vllm_group_fields: group,
            };
            let b =
                kvroute_collector::decode::decode(&encode_events(format, x, 2.0, &events, Some(3)))
                    .unwrap();
            assert_eq!(b.events, events, "{format} group fields {group}");
            assert_eq!(b.dp_rank, Some(3));
        }
    }
    // SGLang carries neither: the same events without them, hashes as signed ints.
    let plain = vec![
        kvroute_sim::wire::stored(Some(5), 1 << 63, &[1, 2, 3, 4], 4),
        KvEvent::BlockRemoved {
            hashes: vec![EngineHash(u64::MAX)],
            tier: Tier::Cpu,
        },
        KvEvent::AllBlocksCleared,
    ];
    for format in [EventFormat::Sglang, EventFormat::SglangLegacy] {
        let b = kvroute_collector::decode::decode(&encode_events(
            format,
            Extras::engine(format),
            2.0,
            &plain,
            None,
        ))
        .unwrap();
        assert_eq!(b.events, plain, "{format}");
        assert_eq!(b.dp_rank, None);
    }
}
