//! The ingest processes' membership task: beats on `<prefix>.ingest.alive`, listens to the
//! others', and opens or closes this process's engine subscribers as ownership
//! ([`super::ownership`]) moves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::StreamExt;
use kvroute::event::WorkerId;
use tracing::{debug, info};

use super::ownership::{Members, BEAT};
use super::{count, wire, worker_key, Bus};
use crate::shared::Shared;

/// Beats, listens, and opens or closes engine subscribers as ownership moves, for as long as
/// the collector runs.
pub async fn run(
    shared: Arc<Shared>,
    bus: Arc<Bus>,
    client: async_nats::Client,
    js: jetstream::Context,
) {
    if !bus.splits_engines() {
        return;
    }
    let subject = format!("{}.ingest.alive", bus.config.subject_prefix);
    let me = bus.ownership.me();
    let mut members = Members::new(me, Instant::now());
    let mut backoff = Duration::from_millis(100);
    let mut beats = loop {
        match client.subscribe(subject.clone()).await {
            Ok(s) => break s,
            Err(e) => {
                debug!(error = %e, "nats: ingest membership subscription failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    };
    let mut tick = tokio::time::interval(BEAT);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_up = true;
    loop {
        tokio::select! {
            m = beats.next() => match m {
                Some(msg) => match std::str::from_utf8(&msg.payload).ok().and_then(|s| s.parse().ok()) {
                    Some(member) => members.note(member, Instant::now()),
                    None => count(&shared.metrics, "in", "member_undecodable"),
                },
                None => return,
            },
            _ = tick.tick() => {
                if client.publish(subject.clone(), me.to_string().into()).await.is_err() {
                    count(&shared.metrics, "out", "member_dropped");
                }
                let now = Instant::now();
                // Without NATS no beat arrives: the others would all look gone and this process
                // would take every engine. Who reads what stays as it was until the connection
                // is back and the beats have been heard again.
                let up = bus.is_connected();
                if up && !was_up {
                    members.relisten(now);
                }
                was_up = up;
                if !up || !members.settled(now) {
                    continue;
                }
                let live = members.live(now);
                if bus.ownership.set(live.clone()) {
                    info!(members = live.len(), "nats: ingest members changed; engines re-split");
                }
                reconcile(&shared, &bus, &js).await;
            }
        }
    }
}

/// Starts the subscribers of the engines this process owns and does not read yet, from the
/// stream's last batch of each; stops the ones it no longer owns.
async fn reconcile(shared: &Arc<Shared>, bus: &Bus, js: &jetstream::Context) {
    let workers: Vec<(WorkerId, String, String)> = shared
        .read()
        .workers()
        .filter(|w| w.source.is_none())
        .map(|w| {
            (
                w.id,
                worker_key(&w.reg.instance_id, w.dp_rank()),
                bus.subject_of(&w.reg, w.dp_rank()),
            )
        })
        .collect();
    for (id, key, subject) in workers {
        let owned = bus.ownership.owns(&key);
        let reading = shared.reads(id);
        if owned && !reading {
            let here = shared.read().worker(id).and_then(|w| w.status.last_seq);
            let stream = last_batch_seq(bus, js, &subject).await;
            let last = match (here, stream) {
                (Some(h), Some(s)) => Some(h.min(s)),
                (h, s) => h.or(s),
            };
            info!(worker = %key, from = ?last, "nats: this process now reads the engine");
            shared.start_subscriber(id, last);
        } else if !owned && reading {
            info!(worker = %key, "nats: another ingest process now reads the engine");
            shared.stop_subscriber(id);
        }
    }
}

/// The engine sequence number of the last batch the stream holds on `subject`, if its last
/// message is a batch (otherwise the new reader starts over and the replicas skip the copies).
async fn last_batch_seq(bus: &Bus, js: &jetstream::Context, subject: &str) -> Option<u64> {
    let stream = js.get_stream(&bus.config.stream).await.ok()?;
    let msg = stream.get_last_raw_message_by_subject(subject).await.ok()?;
    let env = wire::decode(&msg.payload).ok()?;
    (env.kind == wire::Kind::Batch).then_some(env.seq)
}
