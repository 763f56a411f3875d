//! The publisher task: drains the outbox in order onto the event stream and the registry.
//!
//! Batches go out in windows of up to [`WINDOW`] publishes whose acknowledgements are awaited
//! together. When any fails (NATS down, a timeout), the window is sent again from the first
//! failure after a growing pause; each message carries a `Nats-Msg-Id`, so JetStream drops the
//! copies of those that had landed. Registry writes wait for the batches before them, so a
//! batch never reaches the stream before its worker's registration is in the registry.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::{self, stream};
use tracing::{debug, info, warn};

use super::{count, registry, Bus, Outgoing};
use crate::shared::Shared;

/// Publishes in flight before their acknowledgements are awaited.
pub const WINDOW: usize = 256;
/// Longest pause between two attempts of a failed window.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// JetStream drops a message whose id it saw within this window.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The stream's configuration from the settings.
pub fn stream_config(bus: &Bus, max_message_bytes: usize) -> stream::Config {
    stream::Config {
        name: bus.config.stream.clone(),
        subjects: vec![format!("{}.events.>", bus.config.subject_prefix)],
        max_age: bus.config.max_age,
        max_bytes: bus.config.max_bytes,
        max_message_size: i32::try_from(max_message_bytes).unwrap_or(i32::MAX),
        storage: stream::StorageType::File,
        discard: stream::DiscardPolicy::Old,
        // The server refuses a window longer than the age limit.
        duplicate_window: DUPLICATE_WINDOW.min(bus.config.max_age),
        ..Default::default()
    }
}

/// The largest message this collector publishes or reads: the setting, and never more than
/// the server takes (its `max_payload`).
pub fn message_limit(bus: &Bus, js: &jetstream::Context) -> usize {
    let server = js.client().server_info().max_payload;
    if server == 0 {
        bus.config.max_message_bytes
    } else {
        bus.config.max_message_bytes.min(server)
    }
}

/// Creates the stream; an ingest role also brings its limits to its settings (the ingest
/// side owns them: an index replica only reads). Retried until it works.
pub async fn ensure_stream(bus: &Bus, js: &jetstream::Context) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let config = stream_config(bus, message_limit(bus, js));
        let made = if bus.config.role.ingests() {
            js.create_or_update_stream(config)
                .await
                .map(|info| info.state.messages)
                .map_err(|e| e.to_string())
        } else {
            match js.get_or_create_stream(config).await {
                Ok(mut s) => s
                    .info()
                    .await
                    .map(|i| i.state.messages)
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        };
        match made {
            Ok(messages) => {
                debug!(stream = %bus.config.stream, messages, "nats: stream ready");
                return;
            }
            Err(e) => {
                warn!(stream = %bus.config.stream, error = %e, "nats: stream not ready; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Runs until the outbox closes (never, while the collector runs).
pub async fn run(shared: Arc<Shared>, bus: Arc<Bus>, js: jetstream::Context) {
    let Some(mut rx) = bus.take_outbox() else {
        return;
    };
    ensure_stream(&bus, &js).await;
    let registry = registry::open(&bus, &js).await;
    info!(stream = %bus.config.stream, role = ?bus.config.role, "nats: publishing");
    let mut window = Vec::with_capacity(WINDOW);
    loop {
        let Some(first) = rx.recv().await else {
            return;
        };
        window.push(first);
        while window.len() < WINDOW {
            match rx.try_recv() {
                Ok(item) => window.push(item),
                Err(_) => break,
            }
        }
        send_window(&shared, &bus, &js, &registry, &window).await;
        window.clear();
    }
}

/// Sends `window` in order until every item has landed (or was refused for good: too large).
async fn send_window(
    shared: &Shared,
    bus: &Bus,
    js: &jetstream::Context,
    registry: &registry::Registry,
    window: &[Outgoing],
) {
    let mut start = 0;
    let mut backoff = Duration::from_millis(50);
    let mut attempt = 0u32;
    while start < window.len() {
        let limit = message_limit(bus, js);
        let mut pending: Vec<(usize, PublishAckFuture)> = Vec::new();
        let mut failed = None;
        for (i, item) in window.iter().enumerate().skip(start) {
            match item {
                Outgoing::Event {
                    subject,
                    msg_id,
                    body,
                } => {
                    if body.len() > limit {
                        if attempt == 0 {
                            warn!(subject = %subject, bytes = body.len(), limit, "nats: batch over the message limit, not published");
                            count(&shared.metrics, "out", "too_large");
                        }
                        continue;
                    }
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Nats-Msg-Id", msg_id.as_str());
                    match js
                        .publish_with_headers(subject.clone(), headers, body.clone())
                        .await
                    {
                        Ok(ack) => pending.push((i, ack)),
                        Err(e) => {
                            debug!(error = %e, "nats: publish failed");
                            failed = Some(i);
                            break;
                        }
                    }
                }
                Outgoing::Register(_) | Outgoing::Unregister(_) => {
                    if let Some(f) = await_acks(shared, &mut pending).await {
                        failed = Some(f);
                        break;
                    }
                    if let Err(e) = registry.write(item).await {
                        debug!(error = %e, "nats: registry write failed");
                        failed = Some(i);
                        break;
                    }
                    count(&shared.metrics, "out", "registry");
                }
            }
        }
        let late = await_acks(shared, &mut pending).await;
        failed = match (failed, late) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let Some(f) = failed else {
            return;
        };
        if attempt == 0 {
            warn!(
                pending = window.len() - f,
                "nats: publish not acknowledged; retrying in order"
            );
        }
        count(&shared.metrics, "out", "retried");
        start = f;
        attempt += 1;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        // The stream may have been deleted or never created (the server restarted empty).
        if attempt.is_multiple_of(8) {
            ensure_stream(bus, js).await;
        }
    }
}

/// Awaits the acknowledgements in order; returns the index of the first failed one.
async fn await_acks(
    shared: &Shared,
    pending: &mut Vec<(usize, PublishAckFuture)>,
) -> Option<usize> {
    let mut first_failed = None;
    for (i, ack) in pending.drain(..) {
        match ack.await {
            Ok(a) if a.duplicate => count(&shared.metrics, "out", "duplicate"),
            Ok(_) => count(&shared.metrics, "out", "published"),
            Err(e) => {
                debug!(error = %e, "nats: publish not acknowledged");
                first_failed.get_or_insert(i);
            }
        }
    }
    first_failed
}
