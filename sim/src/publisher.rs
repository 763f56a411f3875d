//! The KV-event publisher of one engine rank: a ZMQ PUB socket sending
//! `[topic, seq u64 BE, payload]` and a ROUTER replay socket answering `[.., "", start_seq]`
//! with every buffered batch from `start_seq` on, then the end marker (see [`crate::wire`]).
//! As in vLLM, the PUB and replay sockets bind; seq counts from 0; the replay buffer keeps the
//! last `buffer_steps` batches and silently starts at the oldest one it still has.
//!
//! Beyond a healthy engine, it can misbehave the ways a collector must survive: lose a batch
//! on the PUB side (it stays replayable), send arbitrary bytes as a payload, go away and come
//! back on the same ports either restarted (seq from 0, empty buffer) or only cut off (seq
//! resumed).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvroute::event::KvEvent;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::wire::{self, EventFormat, Extras, ReplayShape, WireEvent};

/// Where and how to publish.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    pub format: EventFormat,
    /// Optional fields the encoder fills (see [`Extras`]).
    pub extras: Extras,
    /// Replay reply framing (normally [`EventFormat::replay_shape`]).
    pub replay_shape: ReplayShape,
    /// The batches' `dp_rank` field.
    pub dp_rank: Option<u32>,
    /// Topic frame (vLLM's default is empty).
    pub topic: String,
    /// PUB bind address, e.g. `tcp://127.0.0.1:5557` (port 0: any).
    pub endpoint: String,
    /// ROUTER bind address for replay, if any.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay (vLLM `buffer_steps`; the engine's default here is 1,000, not
    /// vLLM's 10,000, because a simulated long-prompt batch is ~50 KB and a fleet shares one
    /// machine).
    pub buffer_steps: usize,
}

impl PublisherConfig {
    /// Both sockets on a free loopback port, dp rank 0, vLLM's 10,000-batch buffer, only the
    /// mandatory fields: the engine side of the collector's and the filter's tests.
    pub fn loopback(format: EventFormat) -> PublisherConfig {
        PublisherConfig {
            format,
            extras: Extras {
                vllm_group_fields: false,
            },
            replay_shape: format.replay_shape(),
            dp_rank: Some(0),
            topic: "kv@sim@model".into(),
            endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            buffer_steps: 10_000,
        }
    }
}

/// Sequence numbering and the replay buffer, changed together so that channel order, seq
/// order and buffer order always agree.
#[derive(Debug)]
struct Log {
    next_seq: u64,
    buffer: VecDeque<(u64, Bytes)>,
}

type Shared = Arc<Mutex<Log>>;

fn lock(log: &Shared) -> MutexGuard<'_, Log> {
    // A panic elsewhere while holding the lock leaves a consistent log: keep serving it.
    log.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running publisher. Dropping it stops its tasks; [`Publisher::close`] also flushes.
#[derive(Debug)]
pub struct Publisher {
    cfg: PublisherConfig,
    /// `None` once closed.
    tx: Option<mpsc::UnboundedSender<(u64, Bytes)>>,
    /// The bound PUB address (`tcp://ip:port`).
    pub endpoint: String,
    /// The bound replay address.
    pub replay_endpoint: Option<String>,
    published: watch::Receiver<Option<u64>>,
    log: Shared,
    sender: Option<JoinHandle<()>>,
    router: Option<JoinHandle<()>>,
}

/// A publisher failed to start.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("zmq bind {endpoint}: {source}")]
    Bind {
        endpoint: String,
        source: zeromq::ZmqError,
    },
}

/// How long a bind is retried: a port just released (a restarting engine, a test's
/// placeholder listener) can take a moment to become free again.
const BIND_RETRY: Duration = Duration::from_secs(2);

async fn bind_retrying<S: Socket>(socket: &mut S, endpoint: &str) -> Result<String, PublishError> {
    let until = tokio::time::Instant::now() + BIND_RETRY;
    loop {
        match socket.bind(endpoint).await {
            Ok(bound) => return Ok(bound.to_string()),
            Err(source) if tokio::time::Instant::now() >= until => {
                return Err(PublishError::Bind {
                    endpoint: endpoint.to_string(),
                    source,
                })
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

impl Publisher {
    /// Binds the sockets and starts the send and replay tasks.
    ///
    /// # Errors
    /// A socket that cannot bind (after retrying for a short while).
    pub async fn start(cfg: PublisherConfig) -> Result<Publisher, PublishError> {
        let mut pub_socket = zeromq::PubSocket::new();
        let endpoint = bind_retrying(&mut pub_socket, &cfg.endpoint).await?;
        let log: Shared = Arc::new(Mutex::new(Log {
            next_seq: 0,
            buffer: VecDeque::new(),
        }));
        let (tx, mut rx) = mpsc::unbounded_channel::<(u64, Bytes)>();
        let (published_tx, published) = watch::channel(None);
        let topic = Bytes::from(cfg.topic.clone().into_bytes());
        let sender = {
            let topic = topic.clone();
            tokio::spawn(async move {
                while let Some((seq, payload)) = rx.recv().await {
                    let frames = vec![
                        topic.clone(),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ];
                    let msg = ZmqMessage::try_from(frames).expect("three frames");
                    if let Err(e) = pub_socket.send(msg).await {
                        tracing::warn!(error = %e, seq, "kv event send failed");
                    }
                    published_tx.send_replace(Some(seq));
                }
                // Every sender is gone: the publisher closed. Release the port now.
                let _ = pub_socket.close().await;
            })
        };
        let mut replay_endpoint = None;
        let mut router_task = None;
        if let Some(ep) = &cfg.replay_endpoint {
            let mut router = zeromq::RouterSocket::new();
            replay_endpoint = Some(bind_retrying(&mut router, ep).await?);
            router_task = Some(tokio::spawn(serve_replay(
                router,
                log.clone(),
                topic,
                cfg.replay_shape,
            )));
        }
        Ok(Publisher {
            cfg,
            tx: Some(tx),
            endpoint,
            replay_endpoint,
            published,
            log,
            sender: Some(sender),
            router: router_task,
        })
    }

    /// The configuration it was started with (addresses as requested, not as bound).
    pub fn config(&self) -> &PublisherConfig {
        &self.cfg
    }

    /// Queues one encoded batch (the next seq), keeps it for replay; returns its seq.
    pub fn publish(&self, payload: Vec<u8>) -> u64 {
        self.push(Bytes::from(payload), true)
    }

    /// Encodes wire events as one batch stamped now, and publishes it.
    pub fn publish_wire(&self, events: &[WireEvent]) -> u64 {
        let c = &self.cfg;
        self.publish(wire::encode_batch(
            c.format,
            c.extras,
            now_secs(),
            events,
            c.dp_rank,
        ))
    }

    /// Encodes the core's events as one batch stamped now, and publishes it.
    pub fn publish_events(&self, events: &[KvEvent]) -> u64 {
        let wire: Vec<WireEvent> = events.iter().map(WireEvent::from).collect();
        self.publish_wire(&wire)
    }

    /// Like [`Publisher::publish_events`], but the PUB message is lost on the way: the batch
    /// takes its seq and is replayable, subscribers never see it live.
    pub fn publish_events_lost(&self, events: &[KvEvent]) -> u64 {
        let c = &self.cfg;
        let wire: Vec<WireEvent> = events.iter().map(WireEvent::from).collect();
        let payload = wire::encode_batch(c.format, c.extras, now_secs(), &wire, c.dp_rank);
        self.push(Bytes::from(payload), false)
    }

    fn push(&self, payload: Bytes, send: bool) -> u64 {
        let mut log = lock(&self.log);
        let seq = log.next_seq;
        log.next_seq += 1;
        if log.buffer.len() >= self.cfg.buffer_steps.max(1) {
            log.buffer.pop_front();
        }
        log.buffer.push_back((seq, payload.clone()));
        if let (true, Some(tx)) = (send, &self.tx) {
            // Under the lock, so concurrent publishers queue in seq order.
            let _ = tx.send((seq, payload));
        }
        seq
    }

    /// The seq the next batch gets.
    pub fn next_seq(&self) -> u64 {
        lock(&self.log).next_seq
    }

    /// Continues numbering at `seq`: an engine that was only cut off, not restarted.
    pub fn resume_seq(&self, seq: u64) {
        lock(&self.log).next_seq = seq;
    }

    /// The seq of the last batch sent, watched.
    pub fn published(&self) -> watch::Receiver<Option<u64>> {
        self.published.clone()
    }

    /// Copies of the buffered batches (what replay can return).
    pub fn buffered(&self) -> Vec<(u64, Bytes)> {
        lock(&self.log).buffer.iter().cloned().collect()
    }

    /// Sends what is queued, then closes both sockets; their ports are free when this returns.
    pub async fn close(mut self) {
        if let Some(router) = self.router.take() {
            router.abort();
            let _ = router.await;
        }
        // Closing the channel ends the send task once the queue is empty.
        self.tx = None;
        if let Some(sender) = self.sender.take() {
            let _ = sender.await;
        }
    }

    /// Closes and binds again on the same addresses with an empty buffer and seq back at 0,
    /// as an engine restart does.
    ///
    /// # Errors
    /// A port taken meanwhile.
    pub async fn restart(self) -> Result<Publisher, PublishError> {
        let mut cfg = self.cfg.clone();
        cfg.endpoint = self.endpoint.clone();
        cfg.replay_endpoint = self.replay_endpoint.clone();
        self.close().await;
        Publisher::start(cfg).await
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        for task in self.sender.iter().chain(&self.router) {
            task.abort();
        }
    }
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

async fn serve_replay(
    mut router: zeromq::RouterSocket,
    log: Shared,
    topic: Bytes,
    shape: ReplayShape,
) {
    loop {
        let msg = match router.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "replay recv");
                continue;
            }
        };
        let frames = msg.into_vec();
        // [identity, "", start_seq]; any length of start_seq parses (vLLM uses
        // int.from_bytes), the last 8 bytes count.
        if frames.len() < 2 {
            continue;
        }
        let (Some(identity), Some(start)) = (frames.first().cloned(), frames.last()) else {
            continue;
        };
        let start = start.iter().fold(0u64, |acc, &b| acc << 8 | u64::from(b));
        let batches: Vec<(u64, Bytes)> = lock(&log)
            .buffer
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let mut out = vec![identity.clone(), Bytes::new()];
            out.extend(wire::replay_reply(shape, &topic, seq, &payload));
            if router
                .send(ZmqMessage::try_from(out).expect("frames"))
                .await
                .is_err()
            {
                break;
            }
        }
        let mut end = vec![identity, Bytes::new()];
        end.extend(wire::replay_end(shape));
        let _ = router
            .send(ZmqMessage::try_from(end).expect("frames"))
            .await;
    }
}
