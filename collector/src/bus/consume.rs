//! The index role: the stream in, through this replica's durable pull consumer
//! (`--nats-durable`), into the same [`Shared::apply_batch`] the ZMQ path uses.
//!
//! Each message is acknowledged once applied (ack policy *all*), so after a restart the
//! durable consumer resumes after the last one. With `--state-dir` the replica's index comes
//! back from its snapshot and the durable continues from there: no engine replay. Each
//! snapshot is followed by a cursor file (the stream sequence it holds at least, read before
//! the export); a replica that was killed after acknowledging more than its last snapshot
//! holds has its durable moved back to the cursor (what comes twice is skipped as a second
//! copy). Without `--state-dir`, or without a snapshot yet, the index starts empty, so the
//! durable starts over from the start of the stream (everything its limits still keep).
//!
//! Per worker the consumer follows the engine's sequence numbers as the ingest side applied
//! them: the next one is applied; a jump is counted as a gap (`gap`) and applied, as the ZMQ
//! path does without a replay endpoint; one at or below the last applied is a second copy
//! (`duplicate`) and skipped. Engine restarts and expiries come as their own messages
//! (the ingest side decides them). Bad input costs that message only, counted in
//! `kvroute_bus_messages_total{dir="in",outcome}`: `too_large` (checked before anything
//! is decoded), `undecodable`, `unknown_worker`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer};
use futures_util::StreamExt;
use kvroute::event::WorkerId;
use tracing::{debug, info, warn};

use super::handle::load_cursor;
use super::wire::{self, Kind};
use super::{count, publish, registry, Bus};
use crate::metrics::WorkerLabels;
use crate::shared::Shared;

/// Longest pause between two attempts to reopen the consumer.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long a delivered, unacknowledged message waits before it is delivered again.
const ACK_WAIT: Duration = Duration::from_secs(5);
/// Most messages, and bytes, one pull asks for. The client's default (200 messages, no byte
/// bound) lets a replica catching up after a restart buffer up to 200 maximum-size messages
/// (200 MiB at a 1 MiB `max_payload`) before it has applied one. The byte bound is at least
/// two of the largest messages the server takes: a pull whose bound is below one message would
/// never deliver it.
const PULL_MESSAGES: usize = 64;
const PULL_BYTES: usize = 8 << 20;

/// What the consumer knows per worker: the last engine sequence number applied, under the
/// registration it was applied to (a worker unregistered and registered again, or another
/// one in its slot, starts over).
#[derive(Debug, Default)]
struct Follow {
    last: HashMap<WorkerId, (u64, u64)>,
}

impl Follow {
    fn get(&self, id: WorkerId, generation: u64) -> Option<u64> {
        self.last
            .get(&id)
            .filter(|(g, _)| *g == generation)
            .map(|&(_, seq)| seq)
    }
}

/// Runs for as long as the collector does; reopens the consumer after every error.
pub async fn run(shared: Arc<Shared>, bus: Arc<Bus>, js: jetstream::Context) {
    let registry = registry::open(&bus, &js).await;
    let mut follow = Follow::default();
    // From --state-dir: what the snapshot had applied.
    for w in shared.read().workers() {
        if let (None, Some(s)) = (w.source, w.status.last_seq) {
            follow.last.insert(w.id, (w.generation, s));
        }
    }
    // Only the first opening looks at the snapshot; later ones (after an error) go on from
    // what this process acknowledged.
    let mut start = Some(
        match shared.config.state_dir.as_deref().and_then(load_cursor) {
            Some(seq) => Start::After(seq),
            None => Start::Over,
        },
    );
    let mut backoff = Duration::from_millis(100);
    loop {
        match open(&bus, &js, start).await {
            Ok((c, stream)) => {
                let from = match start {
                    Some(Start::After(seq)) => Some(seq),
                    Some(Start::Over) => Some(0),
                    None => None,
                };
                shared.write().feed.set_stream(stream, from, Instant::now());
                start = None;
                bus.set_consumer_problem(None);
                info!(durable = %bus.config.durable, "nats: consuming the stream");
                let pulled = c
                    .stream()
                    .max_messages_per_batch(PULL_MESSAGES)
                    .max_bytes_per_batch(PULL_BYTES.max(2 * js.client().server_info().max_payload))
                    .messages()
                    .await;
                match pulled {
                    Ok(mut messages) => {
                        backoff = Duration::from_millis(100);
                        let limit = publish::message_limit(&bus, &js);
                        while let Some(m) = messages.next().await {
                            match m {
                                Ok(msg) => {
                                    let applied = on_message(
                                        &shared,
                                        &registry,
                                        &mut follow,
                                        limit,
                                        &msg.payload,
                                    )
                                    .await;
                                    if let Ok(info) = msg.info() {
                                        bus.set_applied(info.stream_sequence);
                                        shared.write().feed.mark(
                                            info.stream_sequence,
                                            applied,
                                            Instant::now(),
                                        );
                                    }
                                    if let Err(e) = msg.ack().await {
                                        debug!(error = %e, "nats: ack failed");
                                    }
                                }
                                Err(e) => {
                                    debug!(error = %e, "nats: consumer interrupted");
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => debug!(error = %e, "nats: pull stream not started"),
                }
            }
            Err(e) => {
                warn!(durable = %bus.config.durable, error = %e, "nats: consumer not ready; retrying");
                bus.set_consumer_problem(Some(format!("consumer not ready ({e})")));
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Where the first opening of the durable consumer starts.
#[derive(Clone, Copy, Debug)]
enum Start {
    /// The index is empty: from the start of the stream.
    Over,
    /// The snapshot holds the stream up to this sequence: from the durable's position if it
    /// is not past it, else from just after it.
    After(u64),
}

/// The identity of a stream for feed handovers ([`kvroute::feed::StreamMark`]): its name
/// and creation time, so that replicas of one stream agree and a stream deleted and made
/// again under the same name is another. Never 0.
fn stream_identity(info: &async_nats::jetstream::stream::Info) -> u64 {
    let created = info.created.unix_timestamp_nanos();
    let mut bytes = info.config.name.as_bytes().to_vec();
    bytes.extend_from_slice(&created.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&bytes).max(1)
}

/// The durable consumer and its stream's identity; `start`: see [`Start`], `None` to take
/// it as it is.
async fn open(
    bus: &Bus,
    js: &jetstream::Context,
    start: Option<Start>,
) -> Result<(consumer::PullConsumer, u64), String> {
    publish::ensure_stream(bus, js).await;
    let stream = js
        .get_stream(&bus.config.stream)
        .await
        .map_err(|e| e.to_string())?;
    let identity = stream_identity(stream.cached_info());
    let existing = stream
        .get_consumer::<consumer::pull::Config>(&bus.config.durable)
        .await
        .ok();
    let deliver_policy = match start {
        None => consumer::DeliverPolicy::All,
        Some(Start::Over) => consumer::DeliverPolicy::All,
        Some(Start::After(seq)) => consumer::DeliverPolicy::ByStartSequence {
            start_sequence: seq + 1,
        },
    };
    let reset = match (start, &existing) {
        (Some(Start::Over), Some(_)) => true,
        (Some(Start::After(seq)), Some(c)) => c.cached_info().ack_floor.stream_sequence > seq,
        _ => false,
    };
    if reset {
        info!(durable = %bus.config.durable, ?start, "nats: durable consumer moved back to what the index holds");
        stream
            .delete_consumer(&bus.config.durable)
            .await
            .map_err(|e| e.to_string())?;
    } else if let Some(c) = existing {
        return Ok((c, identity));
    }
    stream
        .get_or_create_consumer(
            &bus.config.durable,
            consumer::pull::Config {
                durable_name: Some(bus.config.durable.clone()),
                deliver_policy,
                ack_policy: consumer::AckPolicy::All,
                ack_wait: ACK_WAIT,
                max_ack_pending: 100_000,
                ..Default::default()
            },
        )
        .await
        .map(|c| (c, identity))
        .map_err(|e| e.to_string())
}

/// Applies one stream message; bad input is counted and skipped. Returns whether the
/// message was applied (not bad input, nor a second copy of what the index already holds).
async fn on_message(
    shared: &Arc<Shared>,
    registry: &registry::Registry,
    follow: &mut Follow,
    limit: usize,
    payload: &bytes::Bytes,
) -> bool {
    if payload.len() > limit {
        count(&shared.metrics, "in", "too_large");
        return false;
    }
    let env = match wire::decode(payload) {
        Ok(e) => e,
        Err(e) => {
            debug!(error = %e, "nats: undecodable message");
            count(&shared.metrics, "in", "undecodable");
            return false;
        }
    };
    let Some(id) = registry::resolve(shared, registry, &env.instance_id, env.dp_rank).await else {
        debug!(instance = %env.instance_id, dp = env.dp_rank, "nats: message for an unknown worker");
        count(&shared.metrics, "in", "unknown_worker");
        return false;
    };
    let generation = shared.read().worker(id).map_or(0, |w| w.generation);
    match env.kind {
        Kind::Batch => {
            match follow.get(id, generation) {
                Some(last) if env.seq <= last => {
                    count(&shared.metrics, "in", "duplicate");
                    return false;
                }
                Some(last) if env.seq > last + 1 => {
                    warn!(instance = %env.instance_id, last, seq = env.seq, "nats: sequence gap");
                    count(&shared.metrics, "in", "gap");
                    shared
                        .metrics
                        .gaps
                        .get_or_create(&WorkerLabels::new(&env.instance_id, env.dp_rank))
                        .inc();
                    if let Some(w) = shared.write().worker_mut(id) {
                        w.status.gaps += 1;
                    }
                }
                _ => {}
            }
            follow.last.insert(id, (generation, env.seq));
            match crate::decode::decode(&env.payload) {
                Ok(batch) => {
                    shared.apply_batch(id, env.seq, batch).await;
                    count(&shared.metrics, "in", "applied");
                }
                Err(e) => {
                    debug!(error = %e, "nats: batch payload does not decode");
                    count(&shared.metrics, "in", "undecodable");
                    return false;
                }
            }
        }
        Kind::Reset => {
            shared.write().clear_blocks(id);
            follow.last.remove(&id);
            count(&shared.metrics, "in", "applied");
        }
        Kind::Expired => {
            let mut hub = shared.write();
            hub.clear_blocks(id);
            hub.set_stream_expired(id);
            drop(hub);
            follow.last.remove(&id);
            count(&shared.metrics, "in", "applied");
        }
        Kind::Connected | Kind::Disconnected => {
            shared
                .write()
                .set_connected(id, env.kind == Kind::Connected);
            count(&shared.metrics, "in", "applied");
        }
    }
    shared.notify();
    true
}
