//! Unit tests of the hub's jobs.

use super::*;
use kvroute::api::{RegisterRequest, UnregisterRequest};

fn hub(port: Option<u16>) -> Hub {
    Hub::new(
        HubConfig {
            max_blocks_per_worker: 1000,
            max_pages_per_worker: 1000,
            default_serving_port: port,
            max_query_tokens: 1000,
            feed_log_entries: 1000,
            max_feed_bytes: 1 << 20,
            limits: Limits::default(),
        },
        1,
    )
}

fn reg(instance: &str, endpoint: &str) -> RegisterRequest {
    RegisterRequest {
        instance_id: instance.into(),
        endpoint: endpoint.into(),
        replay_endpoint: None,
        model_name: "m".into(),
        tenant_id: None,
        block_size: 4,
        dp_rank: None,
        lora_name: None,
        cache_salt: None,
        address: None,
    }
}

#[test]
fn serving_address_derivation_rules() {
    let h = hub(Some(8000));
    assert_eq!(
        h.normalize(reg("a", "tcp://10.0.0.5:5557"))
            .unwrap()
            .address
            .as_deref(),
        Some("10.0.0.5:8000")
    );
    let h = hub(None);
    assert_eq!(
        h.normalize(reg("10.0.0.7:9000", "tcp://engine:5557"))
            .unwrap()
            .address
            .as_deref(),
        Some("10.0.0.7:9000")
    );
    assert!(matches!(
        h.normalize(reg("a", "tcp://10.0.0.5:5557")),
        Err(HubError::BadRequest(_))
    ));
    let h = hub(Some(8000));
    assert!(
        h.normalize(reg("a", "tcp://engine.local:5557")).is_err(),
        "a host name gives no IP"
    );
    let mut r = reg("a", "tcp://engine:5557");
    r.address = Some("engine:8000".into());
    assert!(h.normalize(r).is_err(), "address must be an IP literal");
    assert!(
        h.normalize(reg("1.2.3.4:5", "tcp://*:5557")).is_err(),
        "cannot connect to *"
    );
}

#[test]
fn batch_dp_rank_names_a_sibling_worker() {
    let mut h = hub(Some(8000));
    let Registered::New(a) = h.register(reg("a", "tcp://10.0.0.5:5557")).unwrap() else {
        panic!()
    };
    let b = h.resolve(a, Some(2)).unwrap();
    assert_ne!(a, b);
    assert_eq!(h.worker(b).unwrap().dp_rank(), 2);
    assert_eq!(h.resolve(a, Some(2)), Ok(b));
    assert_eq!(h.resolve(a, None), Ok(a));
    let removed = h
        .unregister(&UnregisterRequest {
            instance_id: "a".into(),
            model_name: "m".into(),
            tenant_id: None,
            dp_rank: None,
        })
        .unwrap();
    assert_eq!(removed, vec![a]);
    assert_eq!(h.workers().count(), 0);
}
