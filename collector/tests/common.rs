//! Helpers shared by the integration tests.

use std::time::Duration;

use kvroute::api::{QueryResponse, RegisterRequest};
use kvroute_collector::hub::Hub;
use kvroute_collector::testing::Publisher;
use kvroute_collector::{AppState, Config};

/// Upper bound for every eventual condition; never reached when things work.
pub const DEADLINE: Duration = Duration::from_secs(15);

pub fn config() -> Config {
    Config {
        default_serving_port: Some(8000),
        replay_timeout: Duration::from_secs(3),
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
        replay_endpoint: Some(p.replay_endpoint.clone()),
        model_name: model.into(),
        tenant_id: tenant.map(Into::into),
        block_size,
        dp_rank: None,
        lora_name: None,
        cache_salt: None,
        address: None,
    }
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
            p.publish(&[]).await;
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
