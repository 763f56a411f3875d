//! Registrations over the bus: a JetStream stream (`--nats-registry-stream`) that keeps the
//! last message per subject, `<prefix>.registry.<worker key>` (see [`super::worker_key`]),
//! holding the worker's normalized `/register` body as JSON; an empty message withdraws it
//! (`/unregister`). This is what a JetStream KV bucket is, written out on a plain stream
//! because the client's KV helpers ask for server features Debian's nats-server 2.9 lacks.
//! Not the event stream: its `max_age` would age registrations out while their engines run.
//!
//! Every collector watches the registry (an ordered consumer from each subject's last message)
//! and applies what it sees as if it had been posted to it (ingest roles then open the
//! engine's socket), without publishing it again.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use kvroute::api::{RegisterRequest, UnregisterRequest};
use kvroute::event::WorkerId;
use tracing::{debug, info, warn};

use super::{count, worker_key, Bus, Outgoing};
use crate::hub::Registered;
use crate::shared::Shared;

/// Largest registration message, bytes (the stream refuses larger; the reader skips them).
pub const MAX_VALUE_BYTES: usize = 64 * 1024;

/// The registry stream of one collector.
#[derive(Debug, Clone)]
pub struct Registry {
    js: jetstream::Context,
    stream: stream::Stream,
    prefix: String,
}

impl Registry {
    fn subject(&self, key: &str) -> String {
        format!("{}.registry.{key}", self.prefix)
    }

    /// Publishes one registry item (a registration, or an empty message withdrawing one) and
    /// waits for the stream's acknowledgement.
    ///
    /// # Errors
    /// The server's refusal or a timeout, as text.
    pub async fn write(&self, item: &Outgoing) -> Result<(), String> {
        let (key, value) = match item {
            Outgoing::Register(req) => (
                worker_key(&req.instance_id, req.dp_rank.unwrap_or(0)),
                serde_json::to_vec(req).map_err(|e| e.to_string())?,
            ),
            Outgoing::Unregister(key) => (key.clone(), Vec::new()),
            Outgoing::Event { .. } => return Ok(()),
        };
        self.js
            .publish(self.subject(&key), value.into())
            .await
            .map_err(|e| e.to_string())?
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// The last registry message of `key`, if any.
    async fn last(&self, key: &str) -> Option<bytes::Bytes> {
        match self
            .stream
            .get_last_raw_message_by_subject(&self.subject(key))
            .await
        {
            Ok(m) => Some(m.payload),
            Err(e) => {
                debug!(key, error = %e, "nats: no registry message");
                None
            }
        }
    }
}

/// Opens (or creates) the registry stream; retried until it works.
pub async fn open(bus: &Bus, js: &jetstream::Context) -> Registry {
    let mut backoff = Duration::from_millis(100);
    loop {
        let config = stream::Config {
            name: bus.config.registry_stream.clone(),
            subjects: vec![format!("{}.registry.>", bus.config.subject_prefix)],
            max_messages_per_subject: 1,
            max_message_size: MAX_VALUE_BYTES as i32,
            storage: stream::StorageType::File,
            discard: stream::DiscardPolicy::Old,
            ..Default::default()
        };
        match js.get_or_create_stream(config).await {
            Ok(stream) => {
                return Registry {
                    js: js.clone(),
                    stream,
                    prefix: bus.config.subject_prefix.clone(),
                }
            }
            Err(e) => {
                warn!(stream = %bus.config.registry_stream, error = %e, "nats: registry stream not ready; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Applies one registry message for `key`: a registration registers (locally), an empty
/// message unregisters.
pub fn apply(shared: &Arc<Shared>, key: &str, value: &[u8]) {
    if value.len() > MAX_VALUE_BYTES {
        count(&shared.metrics, "in", "registry_too_large");
        return;
    }
    if value.is_empty() {
        let target = shared
            .read()
            .workers()
            .find(|w| w.source.is_none() && worker_key(&w.reg.instance_id, w.dp_rank()) == key)
            .map(|w| UnregisterRequest {
                instance_id: w.reg.instance_id.clone(),
                model_name: w.reg.model_name.clone(),
                tenant_id: w.reg.tenant_id.clone(),
                dp_rank: Some(w.dp_rank()),
            });
        if let Some(req) = target {
            if shared.unregister_local(&req).is_ok() {
                info!(key, "nats: unregistered from the bus");
                count(&shared.metrics, "in", "registry");
                shared.notify();
            }
        }
        return;
    }
    let req: RegisterRequest = match serde_json::from_slice(value) {
        Ok(r) => r,
        Err(e) => {
            warn!(key, error = %e, "nats: registry message is not a registration; skipped");
            count(&shared.metrics, "in", "registry_undecodable");
            return;
        }
    };
    match shared.register_local(req) {
        Ok(Registered::New(_)) => {
            info!(key, "nats: registered from the bus");
            count(&shared.metrics, "in", "registry");
            shared.notify();
        }
        Ok(Registered::Same(_)) => {}
        Err(e) => {
            warn!(key, error = %e, "nats: registration from the bus refused");
            count(&shared.metrics, "in", "registry_refused");
        }
    }
}

/// The worker a stream message names, registering it from the registry when this collector
/// has not seen its registration yet (the watcher may lag the event stream).
pub async fn resolve(
    shared: &Arc<Shared>,
    registry: &Registry,
    instance_id: &str,
    dp_rank: u32,
) -> Option<WorkerId> {
    let find = || {
        shared
            .read()
            .workers()
            .find(|w| {
                w.source.is_none() && w.reg.instance_id == instance_id && w.dp_rank() == dp_rank
            })
            .map(|w| w.id)
    };
    if let Some(id) = find() {
        return Some(id);
    }
    let key = worker_key(instance_id, dp_rank);
    if let Some(value) = registry.last(&key).await {
        apply(shared, &key, &value);
    }
    find()
}

/// Watches the registry for as long as the collector runs: an ordered consumer from each
/// worker's last message, made again after an error (applying a registration twice is a
/// no-op).
pub async fn watch(shared: Arc<Shared>, bus: Arc<Bus>, js: jetstream::Context) {
    let registry = open(&bus, &js).await;
    let prefix = format!("{}.registry.", bus.config.subject_prefix);
    let mut backoff = Duration::from_millis(100);
    loop {
        let made = registry
            .stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: format!("{prefix}>"),
                deliver_policy: consumer::DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await;
        match made {
            Ok(c) => match c.messages().await {
                Ok(mut messages) => {
                    backoff = Duration::from_millis(100);
                    while let Some(m) = messages.next().await {
                        match m {
                            Ok(msg) => {
                                let key = msg.subject.as_str().strip_prefix(&prefix).unwrap_or("");
                                apply(&shared, key, &msg.payload);
                            }
                            Err(e) => {
                                debug!(error = %e, "nats: registry watch interrupted");
                                break;
                            }
                        }
                    }
                }
                Err(e) => debug!(error = %e, "nats: registry watch not started"),
            },
            Err(e) => debug!(error = %e, "nats: registry consumer not made"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}
