//! Gateway load reports over NATS core (`<prefix>.load`, no persistence: a report is only
//! worth its next one): a report a collector accepted on `POST /v1/load` is passed on to every
//! other collector of the bus, so each index replica sums the same fleet load whichever one a
//! gateway reports to.
//!
//! Worker ids are each collector's own slots, and epochs its own feed's, so a report travels
//! with workers named by `(instance_id, dp_rank)`; the receiver maps them to its ids, leaves
//! out the workers it does not know yet, and applies it through [`crate::fleet::Fleet::report`]
//! under its own epoch (the sender checked the gateway's). A collector ignores its own.

use std::sync::Arc;
use std::time::Instant;

use async_nats::Client;
use bytes::Bytes;
use futures_util::StreamExt;
use kvroute::event::WorkerId;
use serde::{Deserialize, Serialize};
use tracing::debug;

use super::{count, Bus};
use crate::fleet::{HeldReport, LoadReport};
use crate::shared::Shared;

/// Largest load message read, bytes.
pub const MAX_LOAD_BYTES: usize = 1 << 20;

/// One report on the wire.
#[derive(Debug, Serialize, Deserialize)]
struct LoadMessage {
    /// The sending collector ([`Bus::origin`]).
    origin: u64,
    gateway: String,
    /// The sender's feed epoch, the one the gateway's cumulative counters were counted in
    /// (absent from older senders).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    epoch: Option<u64>,
    workers: Vec<LoadEntry>,
    /// The gateway's routing decisions since its last report (absent from older senders).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    held: Vec<HeldEntry>,
}

/// A `held` entry with its worker named as in [`LoadEntry`].
#[derive(Debug, Serialize, Deserialize)]
struct HeldEntry {
    instance_id: String,
    dp_rank: u32,
    shard: u32,
    key: u64,
    blocks: u32,
    ttl_ms: u32,
}

#[derive(Debug, Serialize, Deserialize)]
struct LoadEntry {
    instance_id: String,
    dp_rank: u32,
    requests: i64,
    prefill_tokens: i64,
    decode_tokens: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    predicted_cached_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    routed_prompt_tokens: Option<u64>,
}

/// Passes an accepted report on to the other collectors (without waiting; dropped and counted
/// when the queue to NATS is full). `table`: this collector's workers by id.
pub fn fan_out(shared: &Shared, report: &LoadReport, table: &[(WorkerId, String, u32)]) {
    let Some(bus) = &shared.bus else {
        return;
    };
    let workers = report
        .workers
        .iter()
        .filter_map(|w| {
            let (_, instance, dp) = table.iter().find(|t| t.0 .0 == w.worker)?;
            Some(LoadEntry {
                instance_id: instance.clone(),
                dp_rank: *dp,
                requests: w.requests,
                prefill_tokens: w.prefill_tokens,
                decode_tokens: w.decode_tokens,
                predicted_cached_tokens: w.predicted_cached_tokens,
                routed_prompt_tokens: w.routed_prompt_tokens,
            })
        })
        .collect();
    let held = report
        .held
        .iter()
        .filter_map(|h| {
            let (_, instance, dp) = table.iter().find(|t| t.0 .0 == h.worker)?;
            Some(HeldEntry {
                instance_id: instance.clone(),
                dp_rank: *dp,
                shard: h.shard,
                key: h.key,
                blocks: h.blocks,
                ttl_ms: h.ttl_ms,
            })
        })
        .collect();
    let msg = LoadMessage {
        origin: bus.origin(),
        gateway: report.gateway.clone(),
        epoch: Some(report.epoch),
        workers,
        held,
    };
    match serde_json::to_vec(&msg) {
        Ok(body) => bus.send_load(&shared.metrics, Bytes::from(body)),
        Err(e) => debug!(error = %e, "nats: load report not encoded"),
    }
}

/// Applies a report another collector passed on; bad ones are counted and skipped.
fn apply(shared: &Shared, bus: &Bus, payload: &[u8]) {
    if payload.len() > MAX_LOAD_BYTES {
        count(&shared.metrics, "in", "load_too_large");
        return;
    }
    let msg: LoadMessage = match serde_json::from_slice(payload) {
        Ok(m) => m,
        Err(_) => {
            count(&shared.metrics, "in", "load_undecodable");
            return;
        }
    };
    if msg.origin == bus.origin() {
        return;
    }
    let now = Instant::now();
    // Lock order: the fleet, then the hub (as `POST /v1/load`).
    let mut fleet = shared.fleet();
    let hub = shared.read();
    let epoch = hub.feed.epoch();
    let known = hub.workers().count();
    let id_of = |instance_id: &str, dp_rank: u32| {
        hub.workers()
            .find(|w| w.reg.instance_id == instance_id && w.dp_rank() == dp_rank)
            .map(|w| w.id)
    };
    let workers: Vec<serde_json::Value> = msg
        .workers
        .iter()
        .filter_map(|e| {
            let id = id_of(&e.instance_id, e.dp_rank)?;
            Some(serde_json::json!({
                "worker": id.0,
                "requests": e.requests,
                "prefill_tokens": e.prefill_tokens,
                "decode_tokens": e.decode_tokens,
                "predicted_cached_tokens": e.predicted_cached_tokens,
                "routed_prompt_tokens": e.routed_prompt_tokens,
            }))
        })
        .collect();
    let held: Vec<HeldReport> = msg
        .held
        .iter()
        .filter_map(|h| {
            Some(HeldReport {
                worker: id_of(&h.instance_id, h.dp_rank)?.0,
                shard: h.shard,
                key: h.key,
                blocks: h.blocks,
                ttl_ms: h.ttl_ms,
            })
        })
        .collect();
    drop(hub);
    let mut report: LoadReport = match serde_json::from_value(serde_json::json!({
        "gateway": msg.gateway,
        "epoch": epoch,
        "workers": workers,
        "held": held,
    })) {
        Ok(r) => r,
        Err(_) => {
            count(&shared.metrics, "in", "load_undecodable");
            return;
        }
    };
    // The origin counted in its own epoch; without one, a run this collector cannot place.
    report.relayed_epoch = Some(msg.epoch.unwrap_or(msg.origin));
    let is_worker = |id: WorkerId| shared.read().worker(id).is_some();
    match fleet.report(&report, epoch, is_worker, known, now) {
        Ok(()) => count(&shared.metrics, "in", "load_applied"),
        Err(e) => {
            debug!(error = %e, "nats: load report from another collector refused");
            count(&shared.metrics, "in", "load_refused");
        }
    }
}

/// Publishes this collector's accepted reports and applies the others', for as long as the
/// collector runs (NATS core: what is sent while the server is away is lost, and healed by
/// the gateway's next report).
pub async fn run(shared: Arc<Shared>, bus: Arc<Bus>, client: Client) {
    let Some(mut outgoing) = bus.take_load() else {
        return;
    };
    let subject = format!("{}.load", bus.config.subject_prefix);
    let mut backoff = std::time::Duration::from_millis(100);
    let mut incoming = loop {
        match client.subscribe(subject.clone()).await {
            Ok(s) => break s,
            Err(e) => {
                debug!(error = %e, "nats: load subscription failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(std::time::Duration::from_secs(2));
            }
        }
    };
    loop {
        tokio::select! {
            m = incoming.next() => match m {
                Some(msg) => apply(&shared, &bus, &msg.payload),
                None => return,
            },
            body = outgoing.recv() => match body {
                Some(body) => {
                    if client.publish(subject.clone(), body).await.is_err() {
                        count(&shared.metrics, "out", "load_dropped");
                    } else {
                        count(&shared.metrics, "out", "load");
                    }
                }
                None => return,
            },
        }
    }
}
