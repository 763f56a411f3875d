//! Hostile ZMQ publishers against the real binary: a peer that completes the ZMTP 3.0 greeting
//! and NULL handshake as a PUB, then sends a frame header claiming 2^62 bytes, and on its next
//! connection a whole frame over `--max-zmq-message-bytes`. The process must stay up with a
//! small RSS, count both refusals, and keep serving a good engine's blocks.

mod hostile_common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hostile_common::*;
use kvroute_sim::publisher::{Publisher, PublisherConfig};
use kvroute_sim::wire::{stored, EventFormat};

const LIMIT: usize = 1 << 20;

/// The ZMTP 3.0 greeting: signature, version 3.0, mechanism NULL, as-server 0, filler.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The NULL mechanism's READY command announcing a PUB socket.
fn ready_pub() -> Vec<u8> {
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut cmd = vec![0x04, u8::try_from(body.len()).unwrap()];
    cmd.extend_from_slice(&body);
    cmd
}

/// Plays the hostile publisher on one connection: handshake, then `attack`.
fn play(mut s: TcpStream, nth: usize) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut peer = [0u8; 64];
    if s.write_all(&greeting()).is_err() || s.read_exact(&mut peer).is_err() {
        return;
    }
    if s.write_all(&ready_pub()).is_err() {
        return;
    }
    // Whatever the SUB sends from now on (its READY, its subscription) is drained.
    if let Ok(mut r) = s.try_clone() {
        std::thread::spawn(move || {
            let mut sink = [0u8; 4096];
            while r.read(&mut sink).is_ok_and(|n| n > 0) {}
        });
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut frame = vec![0x02u8]; // long frame, no MORE
    if nth == 0 {
        // The 11-byte header that made the pure-Rust decoder try to allocate 4 EiB.
        frame.extend_from_slice(&(1u64 << 62).to_be_bytes());
        let _ = s.write_all(&frame);
    } else {
        // A whole frame, twice the limit, actually sent.
        frame.extend_from_slice(&((2 * LIMIT) as u64).to_be_bytes());
        frame.resize(frame.len() + 2 * LIMIT, 0xab);
        let _ = s.write_all(&frame);
    }
    // Keep the connection open: closing is the collector's job.
    std::thread::sleep(Duration::from_secs(10));
}

fn counter(metrics: &str, name: &str, instance: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("instance=\"{instance}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_publishers_cost_their_connection_not_the_process() {
    let hostile = TcpListener::bind("127.0.0.1:0").unwrap();
    let hostile_addr = hostile.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let seen = connections.clone();
    std::thread::spawn(move || {
        for s in hostile.incoming().flatten() {
            let nth = seen.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || play(s, nth));
        }
    });
    let good = Publisher::start(PublisherConfig::loopback(EventFormat::Vllm033))
        .await
        .expect("publisher");
    let bad_spec = format!("instance_id=bad,endpoint=tcp://{hostile_addr},model=m,block_size=4");
    let good_spec = format!(
        "instance_id=good,endpoint={},replay={},model=m,block_size=4",
        good.endpoint,
        good.replay_endpoint.clone().unwrap_or_default()
    );
    let limit = LIMIT.to_string();
    let mut c = tokio::task::block_in_place(|| {
        Collector::start(&[
            "--default-serving-port",
            "8000",
            "--max-zmq-message-bytes",
            &limit,
            "--worker",
            &bad_spec,
            "--worker",
            &good_spec,
        ])
    });

    // Both attacks land and are refused: the first costs one connection, then the collector
    // connects again (with backoff) and refuses the second.
    let until = Instant::now() + Duration::from_secs(20);
    let metrics = loop {
        let m = tokio::task::block_in_place(|| c.get("/metrics")).map(|r| r.body);
        if let Some(m) = m.filter(|m| counter(m, "kvroute_zmq_protocol_errors_total", "bad") >= 2.0)
        {
            break m;
        }
        assert!(c.alive(), "collector died");
        assert!(
            Instant::now() < until,
            "refusals not counted; connections: {connections:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(connections.load(Ordering::SeqCst) >= 2);
    assert_eq!(
        counter(&metrics, "kvroute_zmq_protocol_errors_total", "good"),
        0.0
    );
    assert!(c.alive());
    let rss = c.rss_kib();
    assert!(rss < 100 * 1024, "RSS {rss} KiB after the attacks");

    // A good engine next door is served as before.
    let tokens: Vec<u32> = (1..=16).collect();
    let body = serde_json::json!({"token_ids": tokens, "model_name": "m"}).to_string();
    good.publish_events(&[stored(None, 100, &tokens, 4)]);
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let r = tokio::task::block_in_place(|| c.post("/query", &body)).expect("query answered");
        assert_eq!(r.status, 200, "{r:?}");
        if r.json()["instances"]["good"]["longest_matched"] == 16 {
            break;
        }
        assert!(
            Instant::now() < until,
            "good engine's blocks not indexed: {r:?}"
        );
        // PUB/SUB may drop what came before the subscription: a new batch shows the gap.
        good.publish_events(&[]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(c.alive());
    eprintln!("collector RSS after both attacks: {} KiB", c.rss_kib());
}
