//! Stage 1 of the data path: one subscriber per registered worker reads the engine's ZMQ
//! publisher through libzmq (the `zmq` crate, the library vLLM's pyzmq uses) and feeds the hub
//! in sequence order.
//!
//! One concern: one engine's event stream, from its sockets to the hub. The SUB, the replay
//! and the sequence rules that choose between them act on one worker's state; split apart,
//! each part would import the others.
//!
//! libzmq enforces what a hostile or broken peer must not get past: `ZMQ_MAXMSGSIZE`
//! (`--max-zmq-message-bytes`) is checked on the frame header before anything is allocated, and
//! `ZMQ_RCVHWM` bounds the queue. A peer over the limit is disconnected by libzmq, counted
//! (`kvroute_zmq_protocol_errors_total`) and reconnected to with backoff; the process is never
//! at risk. The limit is per frame (libzmq's semantics): a message of endlessly many small frames
//! is not bounded by it. libzmq sockets block, so each worker's SUB socket lives on a thread of
//! its own (`pump`)
//! that polls with a short timeout and hands messages to the async side through a bounded
//! channel; dropping the subscriber (unregistration, shutdown) stops the thread within one poll.
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
//! down (`--state-dir`), and again after every reconnection. When the payload hash of batch
//! `last` is known (kept with it, also in the state file) the replay starts at `last` itself:
//! another payload under that number means the engine restarted meanwhile and has published
//! past it, so its blocks are dropped and it is replayed from 0 (replay outcome `restarted`). The SUB socket reconnects by itself
//! (`ZMQ_RECONNECT_IVL`/`_MAX`) when the publisher goes away and comes back on the same
//! address; the monitor's events drive the worker's `connected` status, and a worker
//! disconnected longer than `keep_disconnected` loses its blocks.
//!
//! A message that does not frame or decode costs that message (counted and logged), never the
//! task.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute::event::WorkerId;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};
use xxhash_rust::xxh3::xxh3_64;

use crate::metrics::{OutcomeLabels, WorkerLabels};
use crate::shared::Shared;

/// Recent `(seq, payload hash)` pairs kept per worker to tell a replay's duplicate from an
/// engine restart.
const RECENT: usize = 4096;

/// Most batches one replay may bring (vLLM buffers 10,000 steps by default).
const MAX_REPLAY_BATCHES: usize = 100_000;

/// Messages libzmq queues per socket before the publisher drops (a gap, repaired by replay).
/// With `--max-zmq-message-bytes` this bounds a worker's queued bytes.
pub const RCVHWM: i32 = 1000;

/// Batches in flight between a worker's socket thread and its async task.
const CHANNEL_BATCHES: usize = 64;
/// How long a subscriber waits for its first connection before it warns, once.
const NO_STREAM_WARNING: Duration = Duration::from_secs(10);

/// First and longest wait between reconnection attempts, ms.
const RECONNECT_IVL_MS: i32 = 100;
const RECONNECT_IVL_MAX_MS: i32 = 5000;

/// How often a socket thread looks at its stop flag.
const POLL: Duration = Duration::from_millis(50);

/// libzmq follows a disconnection it will retry with `CONNECT_RETRIED` at once; one it will not
/// retry (a protocol error: a frame over `ZMQ_MAXMSGSIZE`, malformed ZMTP) has nothing after
/// it. This is how long the socket thread waits to tell the two apart.
const RETRY_EVENT_GRACE: Duration = Duration::from_millis(300);

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
    Socket(#[from] zmq::Error),
    #[error("replay brought more than {MAX_REPLAY_BATCHES} batches")]
    TooMany,
    #[error("replay stopped: subscriber shut down")]
    Stopped,
    #[error("replay abandoned by its reader")]
    Abandoned,
    #[error("replay thread failed: {0}")]
    Join(String),
}

/// Limits applied to every socket the collector opens towards an engine.
#[derive(Clone, Copy, Debug)]
pub struct SocketLimits {
    /// `ZMQ_MAXMSGSIZE`: largest frame, bytes.
    pub max_message_bytes: usize,
}

impl SocketLimits {
    fn apply(self, s: &zmq::Socket) -> Result<(), zmq::Error> {
        s.set_linger(0)?;
        s.set_maxmsgsize(i64::try_from(self.max_message_bytes).unwrap_or(i64::MAX))?;
        s.set_rcvhwm(RCVHWM)?;
        s.set_reconnect_ivl(RECONNECT_IVL_MS)?;
        s.set_reconnect_ivl_max(RECONNECT_IVL_MAX_MS)
    }
}

/// A replay under way: its batches as they arrive, then how it ended.
pub struct Replay {
    batches: mpsc::Receiver<RawBatch>,
    end: tokio::task::JoinHandle<Result<usize, ReplayError>>,
}

impl Replay {
    /// The next batch, in the engine's order; `None` once the replay has ended.
    pub async fn next(&mut self) -> Option<RawBatch> {
        self.batches.recv().await
    }

    /// How the replay ended (the batches it brought, or why not all of them). Dropping the
    /// `Replay` before it ended stops the thread at its next batch.
    ///
    /// # Errors
    /// Connection or protocol failure, no end marker within the timeout, or `stop` set.
    pub async fn end(self) -> Result<usize, ReplayError> {
        drop(self.batches);
        self.end
            .await
            .map_err(|e| ReplayError::Join(e.to_string()))?
    }
}

/// Asks the engine's replay socket for every buffered batch with `seq >= start`, on a blocking
/// thread; `stop` ends it early. `ctx` is the worker's own libzmq context (see [`Subscriber`]).
///
/// Batches are handed over as they arrive, a few at a time ([`CHANNEL_BATCHES`]), not
/// gathered first: what a replay holds is bounded by the channel, not by the engine's buffer
/// (vLLM keeps 10,000 steps), times every engine replaying at once when a collector starts.
/// `timeout` bounds the engine's part: the time the reader takes to apply a batch does not
/// count against it.
pub fn replay(
    ctx: zmq::Context,
    endpoint: &str,
    start: u64,
    timeout: Duration,
    limits: SocketLimits,
    stop: Arc<AtomicBool>,
) -> Replay {
    let endpoint = endpoint.to_owned();
    let (tx, batches) = mpsc::channel(CHANNEL_BATCHES);
    let end = tokio::task::spawn_blocking(move || {
        replay_blocking(&ctx, &endpoint, start, timeout, limits, &stop, &tx)
    });
    Replay { batches, end }
}

fn replay_blocking(
    ctx: &zmq::Context,
    endpoint: &str,
    start: u64,
    timeout: Duration,
    limits: SocketLimits,
    stop: &AtomicBool,
    out: &mpsc::Sender<RawBatch>,
) -> Result<usize, ReplayError> {
    let mut until = std::time::Instant::now() + timeout;
    let dealer = ctx.socket(zmq::DEALER)?;
    limits.apply(&dealer)?;
    dealer.connect(endpoint)?;
    // The pipe exists from connect() on (no ZMQ_IMMEDIATE), so this queues rather than blocks.
    dealer.send_multipart([&[][..], &start.to_be_bytes()[..]], zmq::DONTWAIT)?;
    let mut sent = 0usize;
    loop {
        if stop.load(Ordering::Relaxed) {
            return Err(ReplayError::Stopped);
        }
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(ReplayError::Timeout);
        }
        if dealer.poll(zmq::POLLIN, poll_ms(left.min(POLL)))? == 0 {
            continue;
        }
        let mut frames = match dealer.recv_multipart(zmq::DONTWAIT) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => return Err(e.into()),
        };
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
            return Ok(sent);
        }
        if sent >= MAX_REPLAY_BATCHES {
            return Err(ReplayError::TooMany);
        }
        let payload = Bytes::from(frames.swap_remove(frames.len() - 1));
        let waiting = std::time::Instant::now();
        out.blocking_send(RawBatch { seq, payload })
            .map_err(|_| ReplayError::Abandoned)?;
        // The reader's time applying batches is not the engine's.
        until += waiting.elapsed();
        sent += 1;
    }
}

fn poll_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// What a worker's socket thread tells its async task.
#[derive(Debug)]
enum Wire {
    /// The ZMTP handshake with the publisher succeeded.
    Connected,
    /// The connection to the publisher is gone.
    Disconnected,
    /// libzmq dropped the publisher for a protocol error and will not retry by itself.
    ProtocolError,
    Message(Vec<Bytes>),
}

/// Sets the stop flag when the async side goes away (abort included).
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Owns a worker's context; terminating a context waits for its I/O thread (possibly inside a
/// slow DNS lookup), so the last reference is never dropped on an async worker thread.
struct OwnedContext(Option<zmq::Context>);

impl OwnedContext {
    fn get(&self) -> zmq::Context {
        self.0.clone().unwrap_or_default()
    }
}

impl Drop for OwnedContext {
    fn drop(&mut self) {
        if let Some(ctx) = self.0.take() {
            let _ = std::thread::Builder::new()
                .name("kvroute-zmq-term".into())
                .spawn(move || drop(ctx));
        }
    }
}

/// The socket thread of one worker: SUB plus its monitor, rebuilt after a protocol error
/// (libzmq gives up on such a peer) with growing backoff. Returns when `stop` is set or the
/// async side is gone.
fn pump(
    ctx: &zmq::Context,
    endpoint: &str,
    limits: SocketLimits,
    tx: &mpsc::Sender<Wire>,
    stop: &AtomicBool,
) {
    static MONITORS: AtomicU64 = AtomicU64::new(0);
    let mut backoff = Duration::from_millis(u64::from(RECONNECT_IVL_MS.unsigned_abs()));
    let max_backoff = Duration::from_millis(u64::from(RECONNECT_IVL_MAX_MS.unsigned_abs()));
    while !stop.load(Ordering::Relaxed) {
        let monitor = format!(
            "inproc://kvroute-monitor-{}",
            MONITORS.fetch_add(1, Ordering::Relaxed)
        );
        match session(ctx, endpoint, limits, &monitor, tx, stop) {
            Ok(Ended::Stopped) => return,
            Ok(Ended::ProtocolError { had_handshake }) => {
                if tx.blocking_send(Wire::ProtocolError).is_err() {
                    return;
                }
                if had_handshake {
                    backoff = Duration::from_millis(u64::from(RECONNECT_IVL_MS.unsigned_abs()));
                }
            }
            Err(e) => warn!(endpoint, error = %e, "ZMQ socket set-up failed; retrying"),
        }
        // Interruptible sleep before the next socket.
        let until = std::time::Instant::now() + backoff;
        while std::time::Instant::now() < until {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(POLL);
        }
        backoff = (backoff * 2).min(max_backoff);
    }
}

enum Ended {
    Stopped,
    ProtocolError { had_handshake: bool },
}

fn session(
    ctx: &zmq::Context,
    endpoint: &str,
    limits: SocketLimits,
    monitor_addr: &str,
    tx: &mpsc::Sender<Wire>,
    stop: &AtomicBool,
) -> Result<Ended, zmq::Error> {
    let sub = ctx.socket(zmq::SUB)?;
    limits.apply(&sub)?;
    let events = [
        zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
        zmq::SocketEvent::DISCONNECTED,
        zmq::SocketEvent::CONNECT_RETRIED,
    ]
    .iter()
    .fold(0i32, |acc, e| acc | i32::from(e.to_raw()));
    sub.monitor(monitor_addr, events)?;
    let mon = ctx.socket(zmq::PAIR)?;
    mon.set_linger(0)?;
    mon.connect(monitor_addr)?;
    sub.set_subscribe(b"")?;
    sub.connect(endpoint)?;
    debug!(endpoint, "subscribing");
    let handshake = zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw();
    let disconnected = zmq::SocketEvent::DISCONNECTED.to_raw();
    let retried = zmq::SocketEvent::CONNECT_RETRIED.to_raw();
    let mut had_handshake = false;
    let mut silent_since: Option<std::time::Instant> = None;
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(Ended::Stopped);
        }
        let (sub_ready, mon_ready) = {
            let mut items = [sub.as_poll_item(zmq::POLLIN), mon.as_poll_item(zmq::POLLIN)];
            match zmq::poll(&mut items, poll_ms(POLL)) {
                Ok(_) | Err(zmq::Error::EINTR) => {}
                Err(e) => return Err(e),
            }
            (items[0].is_readable(), items[1].is_readable())
        };
        if mon_ready {
            // Monitor messages: [u16 event, u32 value] then the endpoint.
            while let Ok(frames) = mon.recv_multipart(zmq::DONTWAIT) {
                let Some(ev) = frames
                    .first()
                    .and_then(|f| f.get(..2))
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                else {
                    continue;
                };
                let wire = if ev == handshake {
                    had_handshake = true;
                    silent_since = None;
                    Wire::Connected
                } else if ev == disconnected {
                    silent_since = Some(std::time::Instant::now());
                    Wire::Disconnected
                } else {
                    if ev == retried {
                        silent_since = None;
                    }
                    continue;
                };
                if tx.blocking_send(wire).is_err() {
                    return Ok(Ended::Stopped);
                }
            }
        }
        if sub_ready {
            // A bounded drain keeps the monitor and the stop flag looked at.
            for _ in 0..256 {
                match sub.recv_multipart(zmq::DONTWAIT) {
                    Ok(frames) => {
                        let frames = frames.into_iter().map(Bytes::from).collect();
                        if tx.blocking_send(Wire::Message(frames)).is_err() {
                            return Ok(Ended::Stopped);
                        }
                    }
                    Err(zmq::Error::EAGAIN) => break,
                    Err(e) => return Err(e),
                }
            }
        }
        if silent_since.is_some_and(|t| t.elapsed() >= RETRY_EVENT_GRACE) {
            return Ok(Ended::ProtocolError { had_handshake });
        }
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

    /// Whether the payload hash of batch `seq` is known (applied here, or from the state file).
    fn knows(&self, seq: u64) -> bool {
        self.recent.iter().any(|&(s, _)| s == seq)
    }

    fn record(&mut self, seq: u64, hash: u64) {
        if self.recent.len() >= RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, hash));
        self.last = Some(seq);
    }
}

/// How a replay ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replayed {
    /// Whatever it brought is applied (or it failed, counted).
    Done,
    /// The engine replayed another batch under the number last applied here: it restarted
    /// (and has published past that number since). Nothing of it was applied.
    Restarted(u64),
}

/// The subscriber of one registered worker.
pub struct Subscriber {
    shared: Arc<Shared>,
    source: WorkerId,
    labels: WorkerLabels,
    endpoint: String,
    replay_endpoint: Option<String>,
    seq: Seq,
    limits: SocketLimits,
    /// This worker's own libzmq context: libzmq resolves host names on its I/O thread, so a
    /// slow DNS answer for one engine must not stall the others.
    ctx: OwnedContext,
    /// Set when this subscriber is dropped: ends its socket thread and any replay.
    stop: Arc<AtomicBool>,
    /// With `--nats` (an ingest role): where this worker's applied batches are published.
    bus: Option<crate::bus::handle::Route>,
}

impl Subscriber {
    /// `last_seq`: the last sequence number applied before (from `--state-dir`).
    pub fn new(shared: Arc<Shared>, source: WorkerId, last_seq: Option<u64>) -> Option<Subscriber> {
        let hub = shared.hub.read().unwrap_or_else(|e| e.into_inner());
        let w = hub.worker(source)?;
        // The batch applied last before a restart of this collector (`--state-dir`), checked
        // against the engine's replay on connection.
        let recent: VecDeque<(u64, u64)> = match (last_seq, w.status.last_hash) {
            (Some(seq), Some(hash)) if w.status.last_seq == last_seq => [(seq, hash)].into(),
            _ => VecDeque::new(),
        };
        let endpoint = w.reg.endpoint.clone();
        let replay_endpoint = w.reg.replay_endpoint.clone();
        let labels = WorkerLabels::new(&w.reg.instance_id, w.dp_rank());
        let bus = shared
            .bus
            .clone()
            .map(|b| crate::bus::handle::Route::new(b, &w.reg, w.dp_rank()));
        drop(hub);
        let limits = SocketLimits {
            max_message_bytes: shared.config.max_zmq_message_bytes,
        };
        Some(Subscriber {
            shared,
            source,
            labels,
            endpoint,
            replay_endpoint,
            seq: Seq {
                last: last_seq,
                recent,
            },
            limits,
            ctx: OwnedContext(Some(zmq::Context::new())),
            stop: Arc::new(AtomicBool::new(false)),
            bus,
        })
    }

    /// Runs until aborted; the socket thread stops with it.
    pub async fn run(mut self) {
        let _stop = StopOnDrop(self.stop.clone());
        let (tx, mut rx) = mpsc::channel(CHANNEL_BATCHES);
        let (endpoint, limits, stop) = (self.endpoint.clone(), self.limits, self.stop.clone());
        let ctx = self.ctx.get();
        let spawned = std::thread::Builder::new()
            .name("kvroute-zmq-sub".into())
            .spawn(move || pump(&ctx, &endpoint, limits, &tx, &stop));
        if let Err(e) = spawned {
            error!(endpoint = %self.endpoint, error = %e, "cannot start the ZMQ socket thread");
            return;
        }
        self.set_connected(false);
        let keep = self.shared.config.keep_disconnected;
        let mut drop_at: Option<Instant> = None;
        // Said once per subscriber: an engine that never connects is still routed (by load
        // and text), which an operator should know is happening without its cache.
        let mut warn_at = Some(Instant::now() + NO_STREAM_WARNING);
        loop {
            let expiry = async {
                match drop_at {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            let silence = async {
                match warn_at {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                wire = rx.recv() => match wire {
                    Some(Wire::Message(frames)) => self.on_message(frames).await,
                    Some(Wire::Connected) => {
                        info!(endpoint = %self.endpoint, "subscribed");
                        self.set_connected(true);
                        drop_at = None;
                        warn_at = None;
                        self.catch_up().await;
                    }
                    Some(Wire::Disconnected) => {
                        info!(endpoint = %self.endpoint, "publisher disconnected");
                        self.set_connected(false);
                        drop_at.get_or_insert(Instant::now() + keep);
                    }
                    Some(Wire::ProtocolError) => {
                        warn!(
                            endpoint = %self.endpoint,
                            max_message_bytes = self.limits.max_message_bytes,
                            "publisher dropped for a protocol error (frame over the limit or malformed ZMTP); reconnecting with backoff"
                        );
                        self.shared
                            .metrics
                            .zmq_protocol_errors
                            .get_or_create(&self.labels)
                            .inc();
                    }
                    None => {
                        error!(endpoint = %self.endpoint, "ZMQ socket thread ended");
                        self.set_connected(false);
                        return;
                    }
                },
                _ = silence => {
                    warn!(
                        endpoint = %self.endpoint,
                        after_secs = NO_STREAM_WARNING.as_secs(),
                        "no KV event stream from this engine (is it started with --kv-events-config, and the endpoint reachable?); it is routed with an empty cache, by load and text approximate mode"
                    );
                    warn_at = None;
                }
                _ = expiry => {
                    let n = {
                        let mut hub = self.shared.write();
                        let n = hub.clear_blocks(self.source);
                        hub.set_stream_expired(self.source);
                        n
                    };
                    info!(endpoint = %self.endpoint, blocks = n, "disconnected too long; blocks dropped, no longer routed until it reconnects");
                    self.publish(crate::bus::wire::Kind::Expired, 0, &[]);
                    // Start over: when the engine is back, what its replay buffer still
                    // holds comes in again from seq 0.
                    self.seq = Seq { last: None, recent: VecDeque::new() };
                    self.shared.notify();
                    drop_at = None;
                }
            }
        }
    }

    fn set_connected(&self, connected: bool) {
        self.shared.write().set_connected(self.source, connected);
        self.shared.notify();
        let kind = if connected {
            crate::bus::wire::Kind::Connected
        } else {
            crate::bus::wire::Kind::Disconnected
        };
        self.publish(kind, 0, &[]);
    }

    /// Tells the bus (with `--nats`), after the local index has it.
    fn publish(&self, kind: crate::bus::wire::Kind, seq: u64, payload: &[u8]) {
        if let Some(route) = &self.bus {
            route.publish(&self.shared.metrics, kind, seq, payload);
        }
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
                self.engine_restarted(raw.seq);
                if raw.seq > 0 && self.replay_endpoint.is_some() {
                    self.replay_from(0).await;
                }
                if self.seq.last.is_none_or(|l| raw.seq > l) {
                    self.apply(raw).await;
                }
            }
        }
    }

    /// On (re)connection, replays what the engine published since the last batch applied here.
    ///
    /// From that batch itself when its payload hash is known: an engine that restarted while
    /// this collector was away (or disconnected) counts from 0 again, and once it has
    /// published past the last number applied here, a replay from the next number would lay
    /// its new batches over the old blocks and miss its first ones. The batch under the old
    /// number tells: the same payload is the same engine; another is a restart.
    async fn catch_up(&mut self) {
        if self.replay_endpoint.is_none() {
            return;
        }
        let start = match self.seq.last {
            None => 0,
            Some(l) if self.seq.knows(l) => l,
            Some(l) => l + 1,
        };
        if let Replayed::Restarted(seq) = self.replay_from(start).await {
            warn!(endpoint = %self.endpoint, seq, "replay brings another batch under the last number applied: engine restarted");
            self.engine_restarted(seq);
            self.replay_from(0).await;
        }
    }

    /// The engine restarted (empty cache, sequence from 0; vLLM sends no `AllBlocksCleared`):
    /// its blocks go, the bus is told, and the sequence starts over.
    fn engine_restarted(&mut self, seq: u64) {
        self.shared
            .metrics
            .restarts
            .get_or_create(&self.labels)
            .inc();
        // The number and hash go with the blocks: a state file written before the replay has
        // applied anything must not pair the emptied index with the old engine's last batch.
        self.status(|s| {
            s.restarts += 1;
            s.last_seq = None;
            s.last_hash = None;
        });
        self.shared.write().clear_blocks(self.source);
        self.publish(crate::bus::wire::Kind::Reset, seq, &[]);
        self.seq = Seq {
            last: None,
            recent: VecDeque::new(),
        };
    }

    /// Replays from `start` and applies what is newer than the last applied batch.
    async fn replay_from(&mut self, start: u64) -> Replayed {
        let Some(endpoint) = self.replay_endpoint.clone() else {
            return Replayed::Done;
        };
        let mut restarted = None;
        let timeout = self.shared.config.replay_timeout;
        let mut replay = replay(
            self.ctx.get(),
            &endpoint,
            start,
            timeout,
            self.limits,
            self.stop.clone(),
        );
        // Applied as they come: a replay that fails midway leaves the index at the last batch
        // it brought, in order, and the next live batch asks for the rest.
        while let Some(raw) = replay.next().await {
            match self.seq.last {
                Some(l) if raw.seq == l && self.seq.knows(l) && !self.seq.seen(l, &raw.payload) => {
                    restarted = Some(l);
                    break;
                }
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
        let outcome = match (restarted, replay.end().await) {
            (Some(_), _) => "restarted",
            (None, Ok(n)) => {
                debug!(endpoint = %endpoint, start, batches = n, "replayed");
                "ok"
            }
            (None, Err(ReplayError::Timeout)) => {
                warn!(endpoint = %endpoint, start, "replay timed out");
                "timeout"
            }
            (None, Err(e)) => {
                warn!(endpoint = %endpoint, start, error = %e, "replay failed");
                "error"
            }
        };
        debug_assert!(crate::metrics::REPLAY_OUTCOMES.contains(&outcome));
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
        restarted.map_or(Replayed::Done, Replayed::Restarted)
    }

    async fn apply(&mut self, raw: RawBatch) {
        let hash = xxh3_64(&raw.payload);
        self.seq.record(raw.seq, hash);
        match crate::decode::decode(&raw.payload) {
            Ok(batch) => {
                self.shared
                    .apply_engine_batch(self.source, raw.seq, hash, batch)
                    .await;
                self.publish(crate::bus::wire::Kind::Batch, raw.seq, &raw.payload);
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
                    w.status.last_hash = Some(hash);
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
