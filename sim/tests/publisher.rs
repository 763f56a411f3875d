//! The publisher's misbehaviours as a subscriber sees them: a lost batch is missing live but
//! replayable, seq numbering resumes or restarts as asked, replay answers in the chosen shape.

use std::time::Duration;

use bytes::Bytes;
use kvroute_sim::publisher::{Publisher, PublisherConfig};
use kvroute_sim::wire::{stored, EventFormat, ReplayShape, REPLAY_END_SEQ};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

async fn recv(sub: &mut zeromq::SubSocket) -> Option<Vec<Bytes>> {
    tokio::time::timeout(Duration::from_millis(300), sub.recv())
        .await
        .ok()
        .and_then(Result::ok)
        .map(ZmqMessage::into_vec)
}

fn seq_of(frame: &Bytes) -> u64 {
    u64::from_be_bytes(frame.as_ref().try_into().expect("8-byte seq"))
}

/// Subscribes, nudging with empty batches until one arrives (PUB/SUB's slow joiner).
async fn subscribe(p: &Publisher) -> zeromq::SubSocket {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&p.endpoint).await.expect("connect");
    sub.subscribe("").await.expect("subscribe");
    for _ in 0..100 {
        p.publish_events(&[]);
        if recv(&mut sub).await.is_some() {
            // Drain the nudges still in flight.
            while recv(&mut sub).await.is_some() {}
            return sub;
        }
    }
    panic!("subscription never landed");
}

async fn replay(ep: &str, start: u64) -> Vec<Vec<Bytes>> {
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(ep).await.expect("connect replay");
    let req = vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
    dealer
        .send(ZmqMessage::try_from(req).unwrap())
        .await
        .unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
            .await
            .expect("replay reply in time")
            .unwrap()
            .into_vec();
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
    let mut sub = subscribe(&p).await;
    let lost = p.publish_events_lost(&[stored(None, 10, &[1, 2, 3, 4], 4)]);
    let sent = p.publish(b"not msgpack".to_vec());
    assert_eq!(sent, lost + 1);
    let live = recv(&mut sub).await.expect("the batch after the lost one");
    assert_eq!(seq_of(&live[1]), sent, "the lost batch never went out");
    assert_eq!(live[2].as_ref(), b"not msgpack");

    // Old shape: ["", seq, payload] per batch, then ["", ff×8, ""].
    let frames = replay(p.replay_endpoint.as_deref().unwrap(), lost).await;
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
    let frames = replay(p.replay_endpoint.as_deref().unwrap(), 0).await;
    assert_eq!(frames.len(), 2);
    // ["", topic, seq, payload], then ["", "", ff×8, ""].
    assert_eq!(frames[0].len(), 4);
    assert_eq!(frames[0][1].as_ref(), b"kv@sim@model");
    assert_eq!(seq_of(&frames[0][2]), seq);
    assert_eq!(frames[1].len(), 4);
    assert_eq!(frames[1][2].as_ref(), REPLAY_END_SEQ);
}
