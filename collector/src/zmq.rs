//! Stage 1 of the data path: one task per registered worker subscribes to the engine's ZMQ
//! publisher (`zeromq` crate, pure Rust) and feeds the hub in sequence order.
//!
//! Messages are 3 frames `[topic, seq u64 BE, msgpack batch]` ([`RawBatch`] after framing
//! checks). Per worker the task tracks the last applied sequence number:
//!
//! - `seq == last + 1`: apply.
//! - `seq > last + 1` (a gap), or a first message with `seq > 0`: replay the missing batches
//!   through the engine's ROUTER socket with a DEALER (`["", start_seq]`; replies
//!   `["", seq, payload]` before vLLM 0.26, `["", topic, seq, payload]` after; the end marker
//!   has seq `u64::MAX` and an empty payload; bounded by a timeout), then go on. Without a
//!   replay endpoint the gap is counted and the batch applied.
//! - `seq <= last`: a batch already applied through a replay arrives again on the SUB (same
//!   payload: skipped), or the engine restarted and counts from 0 again: vLLM sends no
//!   `AllBlocksCleared` then, so the worker's blocks are dropped before the batch is applied.
//!
//! On connect, a worker with a replay endpoint is replayed from `last + 1` (from 0 when new):
//! this recovers what the engine published before the registration, or while the collector was
//! down (`--state-dir`). The SUB socket reconnects by itself (with backoff) when the publisher
//! goes away and comes back on the same address; the monitor's events drive the worker's
//! `connected` status, and a worker disconnected longer than `keep_disconnected` loses its
//! blocks.
//!
//! A message that does not frame or decode costs that message (counted and logged), never the
//! task.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use kvroute::event::WorkerId;
use tokio::time::Instant;
use tracing::{debug, info, warn};
use xxhash_rust::xxh3::xxh3_64;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::metrics::{OutcomeLabels, WorkerLabels};
use crate::Shared;

/// Recent `(seq, payload hash)` pairs kept per worker to tell a replay's duplicate from an
/// engine restart.
const RECENT: usize = 4096;

/// Most batches one replay may bring (vLLM buffers 10,000 steps by default).
const MAX_REPLAY_BATCHES: usize = 100_000;

/// One message off the wire: transport only, no parsing of the payload.
#[derive(Clone, Debug)]
pub struct RawBatch {
    pub seq: u64,
    pub payload: Bytes,
}

impl RawBatch {
    /// Checks the framing: exactly 3 frames, an 8-byte big-endian sequence number.
    pub fn from_frames(mut frames: Vec<Bytes>) -> Option<RawBatch> {
        if frames.len() != 3 || frames[1].len() != 8 {
            return None;
        }
        let payload = frames.pop()?;
        let seq = u64::from_be_bytes(frames[1][..].try_into().ok()?);
        Some(RawBatch { seq, payload })
    }
}

/// Why a replay gave up.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("replay timed out")]
    Timeout,
    #[error("replay socket: {0}")]
    Socket(#[from] zeromq::ZmqError),
    #[error("replay brought more than {MAX_REPLAY_BATCHES} batches")]
    TooMany,
}

/// Asks the engine's replay socket for every buffered batch with `seq >= start`.
///
/// # Errors
/// Connection or protocol failure, or no end marker within `timeout`.
pub async fn replay(
    endpoint: &str,
    start: u64,
    timeout: Duration,
) -> Result<Vec<RawBatch>, ReplayError> {
    let work = async {
        let mut dealer = DealerSocket::new();
        dealer.connect(endpoint).await?;
        let msg = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&start.to_be_bytes()),
        ])
        .expect("two frames");
        dealer.send(msg).await?;
        let mut out = Vec::new();
        loop {
            let mut frames = dealer.recv().await?.into_vec();
            // A DEALER sees the ROUTER's empty delimiter first.
            if frames.first().is_some_and(|f| f.is_empty()) && frames.len() >= 3 {
                frames.remove(0);
            }
            // Old shape [seq, payload], new shape [topic, seq, payload].
            let (seq, payload) = match frames.len() {
                2 => (&frames[0], &frames[1]),
                3 => (&frames[1], &frames[2]),
                _ => continue,
            };
            let Ok(seq) = <[u8; 8]>::try_from(&seq[..]) else {
                continue;
            };
            let seq = u64::from_be_bytes(seq);
            if seq == u64::MAX && payload.is_empty() {
                let _ = dealer.close().await;
                return Ok(out);
            }
            if out.len() >= MAX_REPLAY_BATCHES {
                return Err(ReplayError::TooMany);
            }
            out.push(RawBatch {
                seq,
                payload: payload.clone(),
            });
        }
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(ReplayError::Timeout),
    }
}

/// Sequence state of one publisher.
struct Seq {
    last: Option<u64>,
    recent: VecDeque<(u64, u64)>,
}

impl Seq {
    fn seen(&self, seq: u64, payload: &[u8]) -> bool {
        let h = xxh3_64(payload);
        self.recent.iter().any(|&(s, p)| s == seq && p == h)
    }

    fn record(&mut self, seq: u64, payload: &[u8]) {
        if self.recent.len() >= RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, xxh3_64(payload)));
        self.last = Some(seq);
    }
}

/// The subscriber of one registered worker.
pub struct Subscriber {
    shared: Arc<Shared>,
    source: WorkerId,
    labels: WorkerLabels,
    endpoint: String,
    replay_endpoint: Option<String>,
    seq: Seq,
}

impl Subscriber {
    /// `last_seq`: the last sequence number applied before (from `--state-dir`).
    pub fn new(shared: Arc<Shared>, source: WorkerId, last_seq: Option<u64>) -> Option<Subscriber> {
        let hub = shared.hub.read().unwrap_or_else(|e| e.into_inner());
        let w = hub.worker(source)?;
        let endpoint = w.reg.endpoint.clone();
        let replay_endpoint = w.reg.replay_endpoint.clone();
        let labels = WorkerLabels::new(&w.reg.instance_id, w.dp_rank());
        drop(hub);
        Some(Subscriber {
            shared,
            source,
            labels,
            endpoint,
            replay_endpoint,
            seq: Seq {
                last: last_seq,
                recent: VecDeque::new(),
            },
        })
    }

    /// Runs until aborted.
    pub async fn run(mut self) {
        let mut backoff = Duration::from_millis(50);
        loop {
            let mut sub = SubSocket::new();
            let mut monitor = sub.monitor();
            let connected = match sub.connect(&self.endpoint).await {
                Ok(()) => sub.subscribe("").await.is_ok(),
                Err(e) => {
                    debug!(endpoint = %self.endpoint, error = %e, "connect failed");
                    false
                }
            };
            if !connected {
                self.set_connected(false);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
            backoff = Duration::from_millis(50);
            info!(endpoint = %self.endpoint, "subscribed");
            self.set_connected(true);
            if self.replay_endpoint.is_some() {
                let from = self.seq.last.map_or(0, |s| s + 1);
                self.replay_from(from).await;
            }
            let keep = self.shared.config.keep_disconnected;
            let mut drop_at: Option<Instant> = None;
            loop {
                let expiry = async {
                    match drop_at {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    msg = sub.recv() => match msg {
                        Ok(msg) => self.on_message(msg.into_vec()).await,
                        Err(e) => {
                            warn!(endpoint = %self.endpoint, error = %e, "receive failed; reconnecting");
                            break;
                        }
                    },
                    ev = monitor.next() => match ev {
                        Some(SocketEvent::Disconnected(_)) => {
                            info!(endpoint = %self.endpoint, "publisher disconnected");
                            self.set_connected(false);
                            drop_at = Some(Instant::now() + keep);
                        }
                        Some(SocketEvent::Connected(..)) => {
                            self.set_connected(true);
                            drop_at = None;
                        }
                        Some(_) => {}
                        None => {
                            // The monitor is gone with the socket's internals: start over.
                            break;
                        }
                    },
                    _ = expiry => {
                        let n = self.shared.write().clear_blocks(self.source);
                        info!(endpoint = %self.endpoint, blocks = n, "disconnected too long; blocks dropped");
                        // Start over: when the engine is back, what its replay buffer still
                        // holds comes in again from seq 0.
                        self.seq = Seq { last: None, recent: VecDeque::new() };
                        self.shared.notify();
                        drop_at = None;
                    }
                }
            }
            self.set_connected(false);
            let _ = sub.close().await;
        }
    }

    fn set_connected(&self, connected: bool) {
        self.shared.write().set_connected(self.source, connected);
        self.shared.notify();
    }

    async fn on_message(&mut self, frames: Vec<Bytes>) {
        self.shared
            .metrics
            .batches
            .get_or_create(&self.labels)
            .inc();
        let Some(raw) = RawBatch::from_frames(frames) else {
            self.shared
                .metrics
                .decode_errors
                .get_or_create(&self.labels)
                .inc();
            warn!(endpoint = %self.endpoint, "message is not [topic, seq(8 bytes), payload]");
            return;
        };
        match self.seq.last {
            None if raw.seq > 0 && self.replay_endpoint.is_some() => {
                self.replay_from(0).await;
                if self.seq.last.is_none_or(|l| raw.seq > l) {
                    self.apply(raw).await;
                }
            }
            None => self.apply(raw).await,
            Some(last) if raw.seq == last.wrapping_add(1) => self.apply(raw).await,
            Some(last) if raw.seq > last => {
                warn!(endpoint = %self.endpoint, last, seq = raw.seq, "sequence gap");
                self.shared.metrics.gaps.get_or_create(&self.labels).inc();
                self.status(|s| s.gaps += 1);
                if self.replay_endpoint.is_some() {
                    self.replay_from(last + 1).await;
                }
                if self.seq.last.is_none_or(|l| raw.seq > l) {
                    self.apply(raw).await;
                }
            }
            Some(_) if self.seq.seen(raw.seq, &raw.payload) => {
                debug!(seq = raw.seq, "duplicate of a replayed batch");
            }
            Some(last) => {
                warn!(endpoint = %self.endpoint, last, seq = raw.seq, "sequence went back: engine restarted");
                self.shared
                    .metrics
                    .restarts
                    .get_or_create(&self.labels)
                    .inc();
                self.status(|s| s.restarts += 1);
                self.shared.write().clear_blocks(self.source);
                self.seq = Seq {
                    last: None,
                    recent: VecDeque::new(),
                };
                if raw.seq > 0 && self.replay_endpoint.is_some() {
                    self.replay_from(0).await;
                }
                if self.seq.last.is_none_or(|l| raw.seq > l) {
                    self.apply(raw).await;
                }
            }
        }
    }

    /// Replays from `start` and applies what is newer than the last applied batch.
    async fn replay_from(&mut self, start: u64) {
        let Some(endpoint) = self.replay_endpoint.clone() else {
            return;
        };
        let timeout = self.shared.config.replay_timeout;
        let outcome = match replay(&endpoint, start, timeout).await {
            Ok(batches) => {
                let n = batches.len();
                for raw in batches {
                    match self.seq.last {
                        Some(l) if raw.seq <= l => continue,
                        Some(l) if raw.seq > l + 1 => {
                            // Older than the engine's buffer: lost for good.
                            self.shared.metrics.gaps.get_or_create(&self.labels).inc();
                            self.status(|s| s.gaps += 1);
                        }
                        None if raw.seq > start => {
                            self.shared.metrics.gaps.get_or_create(&self.labels).inc();
                            self.status(|s| s.gaps += 1);
                        }
                        _ => {}
                    }
                    self.apply(raw).await;
                }
                debug!(endpoint = %endpoint, start, batches = n, "replayed");
                "ok"
            }
            Err(ReplayError::Timeout) => {
                warn!(endpoint = %endpoint, start, "replay timed out");
                "timeout"
            }
            Err(e) => {
                warn!(endpoint = %endpoint, start, error = %e, "replay failed");
                "error"
            }
        };
        self.status(|s| s.replays += 1);
        self.shared
            .metrics
            .replays
            .get_or_create(&OutcomeLabels {
                instance: self.labels.instance.clone(),
                dp: self.labels.dp.clone(),
                outcome,
            })
            .inc();
    }

    async fn apply(&mut self, raw: RawBatch) {
        self.seq.record(raw.seq, &raw.payload);
        match crate::decode::decode(&raw.payload) {
            Ok(batch) => {
                self.shared.apply_batch(self.source, raw.seq, batch).await;
            }
            Err(e) => {
                warn!(endpoint = %self.endpoint, seq = raw.seq, error = %e, "undecodable batch");
                self.shared
                    .metrics
                    .decode_errors
                    .get_or_create(&self.labels)
                    .inc();
                let mut hub = self.shared.write();
                if let Some(w) = hub.worker_mut(self.source) {
                    w.status.decode_errors += 1;
                    w.status.last_seq = Some(raw.seq);
                }
            }
        }
        self.shared.notify();
    }

    fn status(&self, f: impl FnOnce(&mut crate::hub::WorkerStatus)) {
        if let Some(w) = self.shared.write().worker_mut(self.source) {
            f(&mut w.status);
        }
    }
}
