//! The bus state a collector's tasks share ([`Bus`]: the outbox, the connection's health),
//! each worker's [`Route`] onto the stream, and the subject and key names. Nothing here knows
//! the collector's shared state, so that state can hold a [`Bus`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::mpsc;
use tracing::warn;
use xxhash_rust::xxh3::xxh3_64;

use super::settings::BusConfig;
use super::wire::{self, Kind};
use crate::metrics::{BusLabels, Metrics};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A name made safe as one subject token or KV key part: characters other than ASCII
/// letters, digits, `-` and `_` become `_`, and then a hash of the original is appended so
/// two names that map to the same text stay apart.
pub fn token(s: &str) -> String {
    let safe: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if safe == s && !s.is_empty() {
        safe
    } else {
        format!("{safe}-{:08x}", xxh3_64(s.as_bytes()) as u32)
    }
}

/// The subject of a worker's messages: `<prefix>.events.<scope>.<worker>`, scope the
/// (tenant, model) pair and worker the (instance, dp rank) pair, each one token.
pub fn subject(prefix: &str, tenant: &str, model: &str, instance: &str, dp_rank: u32) -> String {
    format!(
        "{prefix}.events.{}.{}",
        token(&format!("{tenant}/{model}")),
        worker_key(instance, dp_rank)
    )
}

/// One token naming a worker: its instance id made safe, then its dp rank.
pub fn worker_key(instance: &str, dp_rank: u32) -> String {
    format!("{}-dp{dp_rank}", token(instance))
}

/// What the outbox carries to the publisher task, in order.
#[derive(Debug)]
pub enum Outgoing {
    /// A stream message; `msg_id` lets JetStream drop a republished or second copy.
    Event {
        subject: String,
        msg_id: String,
        body: Bytes,
    },
    /// A registration to publish to the registry.
    Register(Box<kvroute::api::RegisterRequest>),
    /// A worker key whose registration is withdrawn (an empty message in the registry).
    Unregister(String),
}

/// The bus state one collector shares between its tasks.
#[derive(Debug)]
pub struct Bus {
    pub config: BusConfig,
    outbox: mpsc::Sender<Outgoing>,
    /// Taken once by the publisher task.
    outbox_rx: Mutex<Option<mpsc::Receiver<Outgoing>>>,
    connected: AtomicBool,
    /// When the connection was last lost (or when the bus started, before any connection).
    down_since: Mutex<Option<Instant>>,
    /// Batches not published because the outbox was full.
    dropped: AtomicU64,
    /// When the outbox last dropped one (`/health` says so for [`DROP_MEMORY`] after).
    last_drop: Mutex<Option<Instant>>,
    /// The index consumer's last error, while it has one.
    consumer_problem: Mutex<Option<String>>,
    /// Stream sequence of the last message the index consumer applied (0: none yet).
    applied: AtomicU64,
    /// Accepted gateway load reports on their way to the other collectors ([`super::load`]).
    load: mpsc::Sender<Bytes>,
    load_rx: Mutex<Option<mpsc::Receiver<Bytes>>>,
    /// Tells this collector's own messages apart (several may share a process in tests).
    origin: u64,
    /// Which engines this process reads, with other ingest processes ([`super::owners`]).
    pub ownership: super::ownership::Ownership,
}

impl Bus {
    pub fn new(config: BusConfig) -> Arc<Bus> {
        let (tx, rx) = mpsc::channel(config.outbox_batches);
        let (load, load_rx) = mpsc::channel(LOAD_QUEUE);
        static BUSES: AtomicU64 = AtomicU64::new(0);
        let origin = process_nonce() ^ BUSES.fetch_add(1, Ordering::Relaxed);
        Arc::new(Bus {
            config,
            outbox: tx,
            outbox_rx: Mutex::new(Some(rx)),
            connected: AtomicBool::new(false),
            down_since: Mutex::new(Some(Instant::now())),
            dropped: AtomicU64::new(0),
            last_drop: Mutex::new(None),
            consumer_problem: Mutex::new(None),
            applied: AtomicU64::new(0),
            load,
            load_rx: Mutex::new(Some(load_rx)),
            origin,
            ownership: super::ownership::Ownership::new(origin),
        })
    }

    /// Stream sequence of the last message the index consumer applied (0: none yet).
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    pub(crate) fn set_applied(&self, stream_seq: u64) {
        self.applied.store(stream_seq, Ordering::Release);
    }

    /// This collector's id on the bus.
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// Queues an accepted load report for the other collectors; dropped (counted) when full.
    pub(crate) fn send_load(&self, metrics: &Metrics, body: Bytes) {
        if self.load.try_send(body).is_err() {
            count(metrics, "out", "load_dropped");
        }
    }

    /// The load queue's receiving end, once (for the load task).
    pub(crate) fn take_load(&self) -> Option<mpsc::Receiver<Bytes>> {
        lock(&self.load_rx).take()
    }

    /// The outbox's receiving end, once (for the publisher task).
    pub(crate) fn take_outbox(&self) -> Option<mpsc::Receiver<Outgoing>> {
        lock(&self.outbox_rx).take()
    }

    /// Whether this process splits the engines with other ingest processes (only
    /// `--nats-role ingest` does: a `both` process serves from its own index, so it reads
    /// every engine itself).
    pub fn splits_engines(&self) -> bool {
        self.config.role == super::settings::Role::Ingest
    }

    /// Whether the connection to NATS is up.
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    pub(crate) fn set_connected(&self, up: bool) {
        self.connected.store(up, Ordering::Relaxed);
        let mut since = lock(&self.down_since);
        if up {
            *since = None;
        } else if since.is_none() {
            *since = Some(Instant::now());
        }
    }

    pub(crate) fn set_consumer_problem(&self, p: Option<String>) {
        *lock(&self.consumer_problem) = p;
    }

    /// Why the bus makes the collector degraded, if it does (for `/health`).
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.connected.load(Ordering::Relaxed) {
            let secs = lock(&self.down_since).map_or(0.0, |t| t.elapsed().as_secs_f64());
            let what = if self.config.role.ingests() {
                "batches wait in the outbox"
            } else {
                "the index stays as it is until the stream is back"
            };
            out.push(format!(
                "nats: not connected to {} for {secs:.1} s; serving what it has, {what}",
                self.config.url
            ));
        }
        let queued = self.config.outbox_batches - self.outbox.capacity();
        if queued > 0 && !self.connected.load(Ordering::Relaxed) {
            out.push(format!("nats: {queued} messages wait to be published"));
        }
        let dropped = self.dropped.load(Ordering::Relaxed);
        if lock(&self.last_drop).is_some_and(|t| t.elapsed() < DROP_MEMORY) {
            out.push(format!(
                "nats: {dropped} batches not published (outbox full); index replicas miss them"
            ));
        }
        if let Some(p) = lock(&self.consumer_problem).clone() {
            out.push(format!("nats: {p}"));
        }
        out
    }

    /// Queues `item` for the publisher task without waiting; a full outbox drops it (counted).
    pub(crate) fn send(&self, metrics: &Metrics, item: Outgoing) {
        match self.outbox.try_send(item) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                *lock(&self.last_drop) = Some(Instant::now());
                if self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                    warn!(
                        capacity = self.config.outbox_batches,
                        "nats outbox full: batches are dropped (index replicas will see gaps)"
                    );
                }
                count(metrics, "out", "outbox_full");
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                count(metrics, "out", "closed");
            }
        }
    }

    /// The stream subject of `reg`'s worker.
    pub fn subject_of(&self, reg: &kvroute::api::RegisterRequest, dp_rank: u32) -> String {
        subject(
            &self.config.subject_prefix,
            reg.tenant_id
                .as_deref()
                .unwrap_or(kvroute::scope::DEFAULT_TENANT),
            &reg.model_name,
            &reg.instance_id,
            dp_rank,
        )
    }
}

/// Load reports queued for NATS; more are dropped (the gateway's next one heals it).
pub const LOAD_QUEUE: usize = 1024;

/// How long `/health` stays degraded after the outbox dropped a batch.
pub const DROP_MEMORY: std::time::Duration = std::time::Duration::from_secs(60);

/// A number this process drew at its first use: ids it makes do not collide with another
/// process's, or an earlier run's.
fn process_nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        xxh3_64(&[t.to_le_bytes(), u64::from(std::process::id()).to_le_bytes()].concat())
    })
}

/// The file in `--state-dir` naming the stream sequence a snapshot holds at least.
pub const CURSOR_FILE: &str = "nats-cursor";

/// Records, after a snapshot was written, the stream sequence it holds at least (read before
/// the export): a replica that dies later resumes from there, whatever it had acknowledged.
pub async fn save_cursor(dir: std::path::PathBuf, stream_seq: u64) {
    let tmp = dir.join(format!("{CURSOR_FILE}.tmp"));
    let done = async {
        tokio::fs::write(&tmp, format!("{stream_seq}\n")).await?;
        tokio::fs::rename(&tmp, dir.join(CURSOR_FILE)).await
    };
    if let Err(e) = done.await {
        warn!(dir = %dir.display(), error = %e, "nats cursor not written");
    }
}

/// The stream sequence the snapshot in `dir` holds, when both the snapshot and the cursor
/// are there (a snapshot moved aside leaves the cursor meaningless).
pub fn load_cursor(dir: &std::path::Path) -> Option<u64> {
    if !dir.join(crate::state::FILE).exists() {
        return None;
    }
    std::fs::read_to_string(dir.join(CURSOR_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// One worker's route onto the stream, held by its ZMQ subscriber.
#[derive(Debug, Clone)]
pub struct Route {
    bus: Arc<Bus>,
    subject: String,
    key: String,
    /// Tells this subscriber's messages from an earlier one's of the same worker (a worker
    /// registered again replays its engine's buffer: the same seqs and payloads, which must
    /// not be taken for copies).
    incarnation: u64,
    instance_id: String,
    dp_rank: u32,
}

impl Route {
    pub fn new(bus: Arc<Bus>, reg: &kvroute::api::RegisterRequest, dp_rank: u32) -> Route {
        static ROUTES: AtomicU64 = AtomicU64::new(0);
        Route {
            subject: bus.subject_of(reg, dp_rank),
            key: worker_key(&reg.instance_id, dp_rank),
            incarnation: process_nonce() ^ ROUTES.fetch_add(1, Ordering::Relaxed),
            instance_id: reg.instance_id.clone(),
            dp_rank,
            bus,
        }
    }

    /// Queues one message of this worker. Its id stays the same when the publisher sends it
    /// again, so JetStream drops the second copy (within its duplicate window): worker,
    /// subscriber incarnation, kind, then seq and payload hash for a batch, a counter for a
    /// stream event (those repeat: disconnected, connected, disconnected).
    pub fn publish(&self, metrics: &Metrics, kind: Kind, seq: u64, payload: &[u8]) {
        let msg_id = if kind == Kind::Batch {
            format!(
                "{}.{:x}.{}.{seq}.{:016x}",
                self.key,
                self.incarnation,
                kind.as_str(),
                xxh3_64(payload)
            )
        } else {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            format!(
                "{}.{:x}.{}.{}",
                self.key,
                self.incarnation,
                kind.as_str(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            )
        };
        let body = wire::encode(kind, seq, self.dp_rank, &self.instance_id, payload);
        self.bus.send(
            metrics,
            Outgoing::Event {
                subject: self.subject.clone(),
                msg_id,
                body,
            },
        );
    }
}

/// Counts one bus message under `dir` (`in`, `out`) and `outcome`.
pub(crate) fn count(metrics: &Metrics, dir: &'static str, outcome: &'static str) {
    metrics
        .bus_messages
        .get_or_create(&BusLabels { dir, outcome })
        .inc();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_subject_safe_and_distinct() {
        assert_eq!(token("engine-1"), "engine-1");
        let a = token("10.0.0.1:8000");
        let b = token("10_0_0_1_8000");
        assert!(a.starts_with("10_0_0_1_8000-"));
        assert_ne!(a, b);
        assert!(!token("a.b*c>d e").contains(['.', '*', '>', ' ']));
        assert!(!token("").is_empty());
        assert_eq!(
            subject("kvroute", "default", "llama", "a:1", 2),
            format!(
                "kvroute.events.{}.{}-dp2",
                token("default/llama"),
                token("a:1")
            )
        );
    }
}
