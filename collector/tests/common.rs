//! Helpers shared by the integration tests.

use std::time::Duration;

use kvroute::api::{QueryResponse, RegisterRequest};
use kvroute_collector::hub::Hub;
use kvroute_collector::{AppState, Config};
use kvroute_sim::publisher::{Publisher, PublisherConfig};
use kvroute_sim::wire::{EventFormat, ReplayShape};

/// Upper bound for every eventual condition; never reached when things work (generous: a
/// 2-core CI machine building beside the tests can stall a replay for seconds).
pub const DEADLINE: Duration = Duration::from_secs(40);

pub fn config() -> Config {
    Config {
        default_serving_port: Some(8000),
        // A replay that times out accepts the gap for good, and a test waiting for the gap to
        // be filled then never sees it: on a loaded CI machine 3 s was once not enough.
        replay_timeout: Duration::from_secs(10),
        ..Config::default()
    }
}

pub fn registration(
    instance: &str,
    p: &Publisher,
    model: &str,
    tenant: Option<&str>,
    block_size: u32,
) -> RegisterRequest {
    RegisterRequest {
        instance_id: instance.into(),
        endpoint: p.endpoint.clone(),
        replay_endpoint: p.replay_endpoint.clone(),
        model_name: model.into(),
        tenant_id: tenant.map(Into::into),
        block_size,
        dp_rank: None,
        lora_name: None,
        cache_salt: None,
        address: None,
    }
}

/// An engine's publisher on free loopback ports: `format` with only its mandatory fields,
/// replies in `shape`.
pub async fn publisher(format: EventFormat, shape: ReplayShape) -> Publisher {
    Publisher::start(PublisherConfig {
        replay_shape: shape,
        ..PublisherConfig::loopback(format)
    })
    .await
    .expect("bind on loopback")
}

/// An engine's publisher coming back on the addresses it had (`tcp://127.0.0.1:PORT`).
pub async fn publisher_on(endpoint: &str, replay: &str, format: EventFormat) -> Publisher {
    Publisher::start(PublisherConfig {
        endpoint: endpoint.into(),
        replay_endpoint: Some(replay.into()),
        ..PublisherConfig::loopback(format)
    })
    .await
    .expect("bind again")
}

/// Waits until `cond` holds. ZMQ PUB/SUB may drop what was sent before the subscription
/// landed; when the condition is slow to come, an empty batch is published, whose sequence
/// number makes the collector notice the gap and replay the rest.
pub async fn eventually(
    state: &AppState,
    nudge: Option<&mut Publisher>,
    mut cond: impl FnMut(&Hub) -> bool,
) {
    let until = tokio::time::Instant::now() + DEADLINE;
    let mut nudge = nudge;
    loop {
        if state
            .wait_until(Duration::from_millis(250), &mut cond)
            .await
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "condition not reached within {DEADLINE:?}"
        );
        if let Some(p) = nudge.as_deref_mut() {
            p.publish_events(&[]);
        }
    }
}

/// Tokens `start..start + n`.
pub fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

pub fn query(hub: &Hub, tokens: &[u32], model: &str, tenant: Option<&str>) -> QueryResponse {
    hub.query_tokens(tokens, model, tenant, None, None)
        .expect("query")
}

/// The longest match of `instance`, in tokens (0 when absent).
pub fn longest(
    hub: &Hub,
    tokens: &[u32],
    model: &str,
    tenant: Option<&str>,
    instance: &str,
) -> u64 {
    query(hub, tokens, model, tenant)
        .instances
        .get(instance)
        .map_or(0, |m| m.longest_matched)
}
