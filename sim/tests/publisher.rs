//! The publisher's misbehaviours as a subscriber sees them: a lost batch is missing live but
//! replayable, seq numbering resumes or restarts as asked, replay answers in the chosen shape.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use bytes::Bytes;
use kvroute_sim::publisher::{PublishError, Publisher, PublisherConfig};
use kvroute_sim::wire::{stored, EventFormat, ReplayShape, REPLAY_END_SEQ};

// The test side uses blocking libzmq sockets with receive timeouts: the publisher runs on
// threads of its own, so a test body blocked in `recv` holds nothing it needs.

/// A socket of the tests' own context, closed at once when dropped.
fn socket(kind: zmq::SocketType, endpoint: &str, rcvtimeo_ms: i32) -> zmq::Socket {
    let s = zmq::Context::new().socket(kind).expect("socket");
    s.set_linger(0).unwrap();
    s.set_rcvtimeo(rcvtimeo_ms).unwrap();
    s.connect(endpoint).expect("connect");
    s
}

/// The next message, or `None` after the socket's receive timeout.
fn recv(s: &zmq::Socket) -> Option<Vec<Bytes>> {
    s.recv_multipart(0)
        .ok()
        .map(|frames| frames.into_iter().map(Bytes::from).collect())
}

fn seq_of(frame: &Bytes) -> u64 {
    u64::from_be_bytes(frame.as_ref().try_into().expect("8-byte seq"))
}

/// Subscribes, nudging with empty batches until one arrives (PUB/SUB's slow joiner).
fn subscribe(p: &Publisher) -> zmq::Socket {
    let sub = socket(zmq::SUB, &p.endpoint, 300);
    sub.set_subscribe(b"").expect("subscribe");
    for _ in 0..100 {
        p.publish_events(&[]);
        if recv(&sub).is_some() {
            // Drain the nudges still in flight.
            while recv(&sub).is_some() {}
            return sub;
        }
    }
    panic!("subscription never landed");
}

fn replay(ep: &str, start: u64) -> Vec<Vec<Bytes>> {
    let dealer = socket(zmq::DEALER, ep, 10_000);
    dealer
        .send_multipart([&[][..], &start.to_be_bytes()[..]], 0)
        .expect("send replay request");
    let mut out = Vec::new();
    loop {
        let m = recv(&dealer).expect("replay reply in time");
        let end = m.iter().any(|f| f.as_ref() == REPLAY_END_SEQ);
        out.push(m);
        if end {
            return out;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_batch_is_replayable_and_seq_resumes_or_restarts() {
    let p = Publisher::start(PublisherConfig {
        replay_shape: ReplayShape::Old,
        ..PublisherConfig::loopback(EventFormat::Vllm033)
    })
    .await
    .unwrap();
    let sub = subscribe(&p);
    let lost = p.publish_events_lost(&[stored(None, 10, &[1, 2, 3, 4], 4)]);
    let sent = p.publish(b"not msgpack".to_vec());
    assert_eq!(sent, lost + 1);
    let live = recv(&sub).expect("the batch after the lost one");
    assert_eq!(seq_of(&live[1]), sent, "the lost batch never went out");
    assert_eq!(live[2].as_ref(), b"not msgpack");

    // Old shape: ["", seq, payload] per batch, then ["", ff×8, ""].
    let frames = replay(p.replay_endpoint.as_deref().unwrap(), lost);
    assert_eq!(frames.len(), 3);
    assert_eq!(frames[0].len(), 3);
    assert_eq!(seq_of(&frames[0][1]), lost);
    assert_eq!(seq_of(&frames[1][1]), sent);
    assert_eq!(
        frames[2],
        vec![
            Bytes::new(),
            Bytes::from_static(&REPLAY_END_SEQ),
            Bytes::new()
        ]
    );

    p.resume_seq(100);
    assert_eq!(p.publish_events(&[]), 100);
    let (endpoint, replay_ep) = (p.endpoint.clone(), p.replay_endpoint.clone());
    let p = p.restart().await.expect("same ports again");
    assert_eq!((&p.endpoint, &p.replay_endpoint), (&endpoint, &replay_ep));
    assert_eq!(p.next_seq(), 0, "a restarted engine counts from 0");
    assert!(p.buffered().is_empty());
    p.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_replay_shape_carries_the_topic() {
    let p = Publisher::start(PublisherConfig::loopback(EventFormat::SglangLegacy))
        .await
        .unwrap();
    assert_eq!(p.config().replay_shape, ReplayShape::New);
    let seq = p.publish_events(&[stored(None, 1, &[5, 6], 1)]);
    let frames = replay(p.replay_endpoint.as_deref().unwrap(), 0);
    assert_eq!(frames.len(), 2);
    // ["", topic, seq, payload], then ["", "", ff×8, ""].
    assert_eq!(frames[0].len(), 4);
    assert_eq!(frames[0][1].as_ref(), b"kv@sim@model");
    assert_eq!(seq_of(&frames[0][2]), seq);
    assert_eq!(frames[1].len(), 4);
    assert_eq!(frames[1][2].as_ref(), REPLAY_END_SEQ);
}

/// A raw TCP connection libzmq has accepted: its ZMTP greeting has arrived.
fn accepted_connection(endpoint: &str) -> TcpStream {
    let mut s = TcpStream::connect(endpoint.trim_start_matches("tcp://")).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut greeting = [0u8; 1];
    s.read_exact(&mut greeting).expect("ZMTP greeting");
    s
}

/// Reads until the peer closes; false if it still has not after the read timeout.
fn closed_by_peer(mut s: TcpStream) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_ends_every_connection_and_frees_both_ports() {
    let p = Publisher::start(PublisherConfig::loopback(EventFormat::Vllm033))
        .await
        .unwrap();
    let (ep, replay_ep) = (p.endpoint.clone(), p.replay_endpoint.clone().unwrap());
    let sub = accepted_connection(&ep);
    let dealer = accepted_connection(&replay_ep);
    p.close().await;
    // No waiting: close returns once libzmq has closed everything it had open.
    for addr in [&ep, &replay_ep] {
        TcpListener::bind(addr.trim_start_matches("tcp://"))
            .unwrap_or_else(|e| panic!("{addr} still bound after close: {e}"));
    }
    assert!(closed_by_peer(sub), "the PUB connection outlived close");
    assert!(
        closed_by_peer(dealer),
        "the replay connection outlived close"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_that_stays_taken_fails_the_start_and_releases_the_other() {
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let held_ep = format!("tcp://{}", held.local_addr().unwrap());
    let free = TcpListener::bind("127.0.0.1:0").unwrap();
    let free_ep = format!("tcp://{}", free.local_addr().unwrap());
    drop(free);
    let started = std::time::Instant::now();
    let r = Publisher::start(PublisherConfig {
        endpoint: free_ep.clone(),
        replay_endpoint: Some(held_ep.clone()),
        ..PublisherConfig::loopback(EventFormat::Vllm033)
    })
    .await;
    match r {
        Err(PublishError::Bind { endpoint, source }) => {
            assert_eq!(endpoint, held_ep);
            assert_eq!(source, zmq::Error::EADDRINUSE);
        }
        other => panic!("expected a bind error, got {other:?}"),
    }
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "a taken port is retried for a while"
    );
    // The PUB socket that did bind is closed again by the failed start.
    TcpListener::bind(free_ep.trim_start_matches("tcp://")).expect("PUB port released");
    // A malformed address fails at once, with no retry.
    let started = std::time::Instant::now();
    let r = Publisher::start(PublisherConfig {
        endpoint: "tcp://127.0.0.1:port".into(),
        ..PublisherConfig::loopback(EventFormat::Vllm033)
    })
    .await;
    assert!(matches!(r, Err(PublishError::Bind { .. })), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
}
