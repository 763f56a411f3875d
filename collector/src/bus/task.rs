//! The bus tasks of one collector: the connection, the publisher, the registry watcher and,
//! for the index role, the consumer.

use std::sync::Arc;
use std::time::Duration;

use super::handle::Bus;
use super::{consume, dynamo, load, owners, publish, registry};
use crate::shared::Shared;

/// The bus tasks of one collector; aborted on drop of [`Tasks::stop`].
#[derive(Debug, Default)]
pub struct Tasks(Vec<tokio::task::JoinHandle<()>>);

impl Tasks {
    /// Stops every bus task (before the final snapshot, so nothing is applied after it).
    pub fn stop(self) {
        for t in self.0 {
            t.abort();
        }
    }
}

/// Starts the bus tasks of `shared` when `--nats` is set: the connection, the publisher
/// (every role: registrations go through it), the registry watcher, for the index role the
/// consumer, and with `--dynamo-namespace` the Dynamo reader.
pub fn spawn(shared: &Arc<Shared>) -> Tasks {
    let Some(bus) = shared.bus.clone() else {
        return Tasks::default();
    };
    if !bus.config.role.ingests() {
        // Before the listener serves: a reader of another replica that asks this one while
        // it starts waits for the stream rather than taking a snapshot.
        shared.write().feed.expect_stream(std::time::Instant::now());
    }
    let shared = shared.clone();
    Tasks(vec![tokio::spawn(async move {
        let client = match connect(&bus).await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(url = %bus.config.url, error = %e, "nats: bad server address; the bus stays off");
                bus.set_consumer_problem(Some(format!("bad server address ({e})")));
                return;
            }
        };
        let js = async_nats::jetstream::new(client.clone());
        let mut set = tokio::task::JoinSet::new();
        set.spawn(publish::run(shared.clone(), bus.clone(), js.clone()));
        set.spawn(registry::watch(shared.clone(), bus.clone(), js.clone()));
        set.spawn(load::run(shared.clone(), bus.clone(), client.clone()));
        if bus.splits_engines() {
            set.spawn(owners::run(
                shared.clone(),
                bus.clone(),
                client.clone(),
                js.clone(),
            ));
        }
        if !bus.config.role.ingests() {
            set.spawn(consume::run(shared.clone(), bus.clone(), js.clone()));
        }
        if bus.config.dynamo.is_some() {
            set.spawn(dynamo::run(shared.clone(), bus.clone(), client.clone()));
        }
        // The JoinSet aborts its tasks when this task is aborted and drops it.
        while set.join_next().await.is_some() {}
    })])
}

/// Connects, retrying forever in the background: the client reconnects by itself, and the
/// event callback keeps [`Bus`]'s connected flag (and so `/health`) true to the socket.
async fn connect(bus: &Arc<Bus>) -> Result<async_nats::Client, async_nats::ConnectError> {
    let events = bus.clone();
    async_nats::ConnectOptions::new()
        .name("kvroute-collector")
        .retry_on_initial_connect()
        .max_reconnects(None)
        // Back within a second of the server: the default waits grow to several seconds.
        .reconnect_delay_callback(|attempts| Duration::from_millis(100 * attempts.min(10) as u64))
        .connection_timeout(Duration::from_secs(2))
        .request_timeout(Some(Duration::from_secs(5)))
        .event_callback(move |ev| {
            let events = events.clone();
            async move {
                match ev {
                    async_nats::Event::Connected => {
                        tracing::info!("nats: connected");
                        events.set_connected(true);
                    }
                    async_nats::Event::Disconnected => {
                        tracing::warn!("nats: disconnected; reconnecting");
                        events.set_connected(false);
                    }
                    other => tracing::debug!(event = %other, "nats"),
                }
            }
        })
        .connect(bus.config.url.as_str())
        .await
}
