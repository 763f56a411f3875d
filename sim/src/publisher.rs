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
//!
//! The sockets are libzmq's (the `zmq` crate), the library vLLM and SGLang publish with
//! through pyzmq, with vLLM's options: PUB `SNDHWM` 100,000, ROUTER `SNDHWM`
//! 2 × (`buffer_steps` + 1) so that a whole replay fits, `LINGER` 0 on both (vLLM closes them
//! with `linger=0`). libzmq sockets block and are not `Sync`, so each one lives on a thread of
//! its own: the PUB thread sends what [`Publisher::publish`] queues on a channel, the ROUTER
//! thread polls with a short timeout and a stop flag. Each publisher has its own libzmq
//! context, and [`Publisher::close`] joins both threads and then terminates the context, which
//! returns only once libzmq has closed the listeners and every connection: a subscriber sees
//! the engine gone, and the ports are free, when `close` returns.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvroute::event::KvEvent;
use tokio::sync::{oneshot, watch};

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

/// vLLM's `hwm` default: messages the PUB socket queues per subscriber before it drops.
const PUB_SNDHWM: i32 = 100_000;

/// How long a bind is retried: a port just released (a restarting engine, a test's
/// placeholder listener) can take a moment to become free again.
const BIND_RETRY: Duration = Duration::from_secs(2);

/// How often the replay thread looks at its stop flag.
const POLL_MS: i64 = 20;

/// A running publisher. Dropping it stops its threads; [`Publisher::close`] also flushes and
/// waits until the sockets are closed.
#[derive(Debug)]
pub struct Publisher {
    cfg: PublisherConfig,
    /// `None` once closed.
    tx: Option<mpsc::Sender<(u64, Bytes)>>,
    /// The bound PUB address (`tcp://ip:port`).
    pub endpoint: String,
    /// The bound replay address.
    pub replay_endpoint: Option<String>,
    published: watch::Receiver<Option<u64>>,
    log: Shared,
    /// `None` once closed.
    sockets: Option<Sockets>,
}

/// A publisher failed to start.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The address is not one a publisher can bind (e.g. a DP rank offset of a bad port).
    #[error("bad endpoint: {0}")]
    Endpoint(String),
    /// A socket could not be created or given its options.
    #[error("zmq socket for {endpoint}: {source}")]
    Socket {
        endpoint: String,
        source: zmq::Error,
    },
    /// The address stayed taken (retried for a short while), or libzmq rejected it.
    #[error("zmq bind {endpoint}: {source}")]
    Bind {
        endpoint: String,
        source: zmq::Error,
    },
    /// The OS refused a socket thread.
    #[error("socket thread for {endpoint}: {source}")]
    Thread {
        endpoint: String,
        source: std::io::Error,
    },
}

/// The socket threads of one publisher and the context their sockets belong to. Dropped
/// without [`Sockets::shut`], it shuts down on a thread of its own.
struct Sockets {
    /// `None` once shut.
    ctx: Option<zmq::Context>,
    /// Ends the replay thread; the send thread also checks it, to drop its queue on `Drop`.
    stop: Arc<AtomicBool>,
    sender: Option<JoinHandle<()>>,
    router: Option<JoinHandle<()>>,
}

impl fmt::Debug for Sockets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sockets")
            .field("stop", &self.stop)
            .finish_non_exhaustive()
    }
}

impl Sockets {
    fn new() -> Sockets {
        Sockets {
            ctx: Some(zmq::Context::new()),
            stop: Arc::new(AtomicBool::new(false)),
            sender: None,
            router: None,
        }
    }

    fn ctx(&self) -> zmq::Context {
        self.ctx.clone().unwrap_or_default()
    }

    /// Blocks until both threads have closed their sockets and libzmq has closed every
    /// connection and listener. The send thread ends once every channel sender is gone: with
    /// `flush` it sends what is queued first, without it drops the queue.
    fn shut(&mut self, flush: bool) {
        shut(
            self.ctx.take(),
            &self.stop,
            self.sender.take(),
            self.router.take(),
            flush,
        );
    }
}

impl Drop for Sockets {
    fn drop(&mut self) {
        if self.ctx.is_none() {
            return;
        }
        let (ctx, stop) = (self.ctx.take(), self.stop.clone());
        let (sender, router) = (self.sender.take(), self.router.take());
        // Not joined here: a drop may happen on an async worker, or outside any runtime.
        let _ = std::thread::Builder::new()
            .name("kvroute-sim-pub-drop".into())
            .spawn(move || shut(ctx, &stop, sender, router, false));
    }
}

fn shut(
    ctx: Option<zmq::Context>,
    stop: &AtomicBool,
    sender: Option<JoinHandle<()>>,
    router: Option<JoinHandle<()>>,
    flush: bool,
) {
    if !flush {
        stop.store(true, Ordering::Relaxed);
    }
    if sender.is_some_and(|t| t.join().is_err()) {
        tracing::warn!("kv event send thread panicked");
    }
    stop.store(true, Ordering::Relaxed);
    if router.is_some_and(|t| t.join().is_err()) {
        tracing::warn!("replay thread panicked");
    }
    // The sockets held the other references; this last one runs zmq_ctx_term, which waits
    // for libzmq's I/O thread to close what the sockets had open.
    drop(ctx);
}

/// A socket with the publisher's options, bound to `endpoint` (retrying a port in use for
/// [`BIND_RETRY`]); returns it with the address it got.
fn open(
    ctx: &zmq::Context,
    kind: zmq::SocketType,
    endpoint: &str,
    sndhwm: i32,
) -> Result<(zmq::Socket, String), PublishError> {
    let socket_err = |source| PublishError::Socket {
        endpoint: endpoint.to_string(),
        source,
    };
    let socket = ctx.socket(kind).map_err(socket_err)?;
    socket.set_linger(0).map_err(socket_err)?;
    socket.set_sndhwm(sndhwm).map_err(socket_err)?;
    // libzmq takes a bracketed IPv6 host only with ZMQ_IPV6 on.
    socket
        .set_ipv6(endpoint.contains("://["))
        .map_err(socket_err)?;
    let until = Instant::now() + BIND_RETRY;
    loop {
        match socket.bind(endpoint) {
            Ok(()) => break,
            Err(zmq::Error::EADDRINUSE) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(PublishError::Bind {
                    endpoint: endpoint.to_string(),
                    source,
                })
            }
        }
    }
    // The bound address, with the port libzmq picked for port 0.
    let bound = match socket.get_last_endpoint() {
        Ok(Ok(bound)) => bound,
        Ok(Err(_)) => endpoint.to_string(),
        Err(source) => return Err(socket_err(source)),
    };
    Ok((socket, bound))
}

/// What a socket thread reports once it has tried to bind: the bound address, or why not.
type Ready = oneshot::Receiver<Result<String, PublishError>>;

/// Starts a thread that opens a socket and, once it is bound, runs `serve` on it.
fn spawn_socket(
    name: &str,
    ctx: zmq::Context,
    kind: zmq::SocketType,
    endpoint: &str,
    sndhwm: i32,
    serve: impl FnOnce(&zmq::Socket) + Send + 'static,
) -> Result<(JoinHandle<()>, Ready), PublishError> {
    let (ready_tx, ready) = oneshot::channel();
    let ep = endpoint.to_string();
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || match open(&ctx, kind, &ep, sndhwm) {
            Ok((socket, bound)) => {
                if ready_tx.send(Ok(bound)).is_ok() {
                    serve(&socket);
                }
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })
        .map_err(|source| PublishError::Thread {
            endpoint: endpoint.to_string(),
            source,
        })?;
    Ok((thread, ready))
}

/// The bound address a socket thread reports (a thread that died says nothing: a bind error).
async fn bound(ready: Ready, endpoint: &str) -> Result<String, PublishError> {
    ready.await.unwrap_or_else(|_| {
        Err(PublishError::Bind {
            endpoint: endpoint.to_string(),
            source: zmq::Error::ETERM,
        })
    })
}

impl Publisher {
    /// Binds the sockets and starts the send and replay threads.
    ///
    /// # Errors
    /// A socket that cannot bind (after retrying for a short while), or no thread for it.
    pub async fn start(cfg: PublisherConfig) -> Result<Publisher, PublishError> {
        let log: Shared = Arc::new(Mutex::new(Log {
            next_seq: 0,
            buffer: VecDeque::new(),
        }));
        let (tx, rx) = mpsc::channel::<(u64, Bytes)>();
        let (published_tx, published) = watch::channel(None);
        let topic = Bytes::from(cfg.topic.clone().into_bytes());
        let mut sockets = Sockets::new();
        let started = async {
            let stop = sockets.stop.clone();
            let pub_topic = topic.clone();
            let (thread, ready) = spawn_socket(
                "kvroute-sim-pub",
                sockets.ctx(),
                zmq::PUB,
                &cfg.endpoint,
                PUB_SNDHWM,
                move |s| send_loop(s, &rx, &pub_topic, &published_tx, &stop),
            )?;
            sockets.sender = Some(thread);
            let endpoint = bound(ready, &cfg.endpoint).await?;
            let mut replay_endpoint = None;
            if let Some(ep) = &cfg.replay_endpoint {
                // vLLM 0.33's replay SNDHWM: the whole buffer and its end marker, twice over.
                let hwm = i32::try_from(cfg.buffer_steps.saturating_add(1).saturating_mul(2))
                    .unwrap_or(i32::MAX);
                let (stop, log, shape) = (sockets.stop.clone(), log.clone(), cfg.replay_shape);
                let topic = topic.clone();
                let (thread, ready) =
                    spawn_socket("kvroute-sim-replay", sockets.ctx(), zmq::ROUTER, ep, hwm, {
                        move |s| replay_loop(s, &log, &topic, shape, &stop)
                    })?;
                sockets.router = Some(thread);
                replay_endpoint = Some(bound(ready, ep).await?);
            }
            Ok::<_, PublishError>((endpoint, replay_endpoint))
        };
        match started.await {
            Ok((endpoint, replay_endpoint)) => Ok(Publisher {
                cfg,
                tx: Some(tx),
                endpoint,
                replay_endpoint,
                published,
                log,
                sockets: Some(sockets),
            }),
            Err(e) => {
                // Release whatever did bind before reporting.
                drop(tx);
                let _ = tokio::task::spawn_blocking(move || {
                    let mut sockets = sockets;
                    sockets.shut(false);
                })
                .await;
                Err(e)
            }
        }
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

    /// Sends what is queued, then closes both sockets; their ports are free and every
    /// connection is closed when this returns. What libzmq had not yet written to a
    /// subscriber is dropped (linger 0, as vLLM closes).
    pub async fn close(mut self) {
        // Closing the channel ends the send thread once the queue is empty.
        self.tx = None;
        if let Some(sockets) = self.sockets.take() {
            // Joining threads and terminating the context block: off the async workers.
            let flushed = tokio::task::spawn_blocking(move || {
                let mut sockets = sockets;
                sockets.shut(true);
            });
            if let Err(e) = flushed.await {
                tracing::warn!(error = %e, "publisher close failed");
            }
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

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The PUB thread: sends each queued batch as `[topic, seq, payload]` until every sender is
/// gone (or `stop` says to drop the rest).
fn send_loop(
    socket: &zmq::Socket,
    rx: &mpsc::Receiver<(u64, Bytes)>,
    topic: &[u8],
    published: &watch::Sender<Option<u64>>,
    stop: &AtomicBool,
) {
    while let Ok((seq, payload)) = rx.recv() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        // A PUB send never blocks: a subscriber SNDHWM behind loses the batch, as with an
        // engine (a gap the collector repairs by replay).
        let frames: [&[u8]; 3] = [topic, &seq.to_be_bytes(), &payload];
        if let Err(e) = socket.send_multipart(frames, 0) {
            tracing::warn!(error = %e, seq, "kv event send failed");
        }
        published.send_replace(Some(seq));
    }
}

/// The ROUTER thread: answers each `[identity, "", start_seq]` with the buffered batches from
/// `start_seq` on and the end marker, until `stop`.
fn replay_loop(
    router: &zmq::Socket,
    log: &Shared,
    topic: &Bytes,
    shape: ReplayShape,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::Relaxed) {
        match router.poll(zmq::POLLIN, POLL_MS) {
            Ok(0) | Err(zmq::Error::EINTR) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "replay poll");
                std::thread::sleep(Duration::from_millis(POLL_MS.unsigned_abs()));
                continue;
            }
        }
        let frames = match router.recv_multipart(zmq::DONTWAIT) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => {
                tracing::debug!(error = %e, "replay recv");
                continue;
            }
        };
        // [identity, "", start_seq]; any length of start_seq parses (vLLM uses
        // int.from_bytes), the last 8 bytes count.
        if frames.len() < 2 {
            continue;
        }
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let start = start.iter().fold(0u64, |acc, &b| acc << 8 | u64::from(b));
        let batches: Vec<(u64, Bytes)> = lock(log)
            .buffer
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let head = [Bytes::copy_from_slice(identity), Bytes::new()];
        for (seq, payload) in batches {
            let reply = wire::replay_reply(shape, topic, seq, &payload);
            if let Err(e) = router.send_multipart(head.iter().chain(&reply).map(Bytes::as_ref), 0) {
                tracing::debug!(error = %e, seq, "replay send");
                break;
            }
        }
        let end = wire::replay_end(shape);
        if let Err(e) = router.send_multipart(head.iter().chain(&end).map(Bytes::as_ref), 0) {
            tracing::debug!(error = %e, "replay end send");
        }
    }
}
