//! Unit tests of the hub's jobs.

use super::*;
use kvroute::api::{RegisterRequest, UnregisterRequest};
use kvroute::feed::Op;

use super::store::worker_op;

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

fn limited_hub(limits: Limits) -> Hub {
    Hub::new(
        HubConfig {
            max_blocks_per_worker: 10_000,
            max_pages_per_worker: 10_000,
            default_serving_port: Some(8000),
            max_query_tokens: 10_000,
            feed_log_entries: 100_000,
            max_feed_bytes: 1 << 20,
            limits,
        },
        1,
    )
}

fn batch(dp_rank: Option<u32>, events: Vec<kvroute::event::KvEvent>) -> crate::decode::Batch {
    crate::decode::Batch {
        ts: 0.0,
        dp_rank,
        events,
        stats: Default::default(),
    }
}

fn chain(first: u64, n: usize, lora: Option<&str>) -> kvroute::event::KvEvent {
    kvroute::event::KvEvent::BlockStored {
        parent: None,
        blocks: (0..n)
            .map(|i| kvroute::event::StoredBlock {
                hash: kvroute::event::EngineHash(first + i as u64),
                tokens: vec![(first + i as u64) as u32; 4],
                block_hash: None,
            })
            .collect(),
        tier: kvroute::event::Tier::Gpu,
        lora_name: lora.map(Into::into),
        cache_salt: None,
    }
}

#[test]
fn a_batch_applied_in_slices_equals_it_applied_whole() {
    let events = vec![
        chain(1, 1000, None),
        chain(5000, 3, None),
        kvroute::event::KvEvent::BlockRemoved {
            hashes: (500..520).map(kvroute::event::EngineHash).collect(),
            tier: kvroute::event::Tier::Gpu,
        },
    ];
    let mut dumps = Vec::new();
    for slice in [7, 1 << 16] {
        let mut h = limited_hub(Limits {
            slice_blocks: slice,
            ..Limits::default()
        });
        let Registered::New(a) = h.register(reg("a", "tcp://10.0.0.5:5557")).unwrap() else {
            panic!()
        };
        let r = h.apply_batch(a, 1, batch(None, events.clone()));
        assert_eq!(r.events, [2, 1, 0]);
        assert_eq!(r.apply.stored, 1003);
        assert!(r.slices >= if slice == 7 { 146 } else { 1 });
        // Removing hash 500 drops it and its descendants: hashes 1..=499 stay.
        assert_eq!(h.index.worker_blocks(a), 499 + 3, "slice {slice}: {r:?}");
        dumps.push(h.index.export());
    }
    assert_eq!(dumps[0], dumps[1]);
}

#[test]
fn what_an_engine_taught_goes_when_it_restarts_or_stays_away() {
    let mut h = limited_hub(Limits::default());
    let Registered::New(a) = h.register(reg("a", "tcp://10.0.0.5:5557")).unwrap() else {
        panic!()
    };
    h.apply_batch(a, 1, batch(Some(3), vec![chain(1, 4, Some("ad"))]));
    assert_eq!(h.workers().count(), 2);
    assert_eq!(h.alias("default", "ad"), Some(("m", Some("ad"))));
    assert_eq!(h.clear_blocks(a), 4);
    assert_eq!(h.workers().count(), 1, "the dp-rank sibling is gone");
    assert_eq!(h.alias_count(), 0, "the learned alias is gone");
    assert!(h.worker(a).is_some(), "the registration stays");
}

#[test]
fn an_engine_is_routable_unless_there_is_evidence_it_is_down() {
    let mut h = hub(Some(8000));
    let Registered::New(a) = h.register(reg("a", "tcp://10.0.0.5:5557")).unwrap() else {
        panic!()
    };
    let status = |h: &Hub| h.worker(a).unwrap().status.clone();
    let live_in_feed = |h: &Hub| worker_op(h.worker(a).unwrap());
    let is_live = |op: Op| matches!(op, Op::Worker { live: true, .. });
    // Registered, no event ever: a candidate with an empty cache.
    assert_eq!(status(&h).event_stream, EventStream::Never);
    assert!(status(&h).is_routable() && is_live(live_in_feed(&h)));
    // Metrics failing while no stream ever connected: the only evidence there is.
    let entries = h.feed.len();
    h.set_metrics_down(a, true);
    assert!(!status(&h).is_routable() && !is_live(live_in_feed(&h)));
    assert_eq!(h.feed.len(), entries + 1, "the feed hears of it");
    h.set_metrics_down(a, false);
    assert!(status(&h).is_routable());
    // Connected: a failing /metrics alone does not take a live stream's engine away.
    h.set_connected(a, true);
    h.set_metrics_down(a, true);
    assert_eq!(status(&h).event_stream, EventStream::Connected);
    assert!(status(&h).is_routable());
    // Dropped: still routable until keep_disconnected passes, and now the metrics count.
    h.set_metrics_down(a, false);
    h.set_connected(a, false);
    assert_eq!(status(&h).event_stream, EventStream::Dropped);
    assert!(status(&h).is_routable());
    let entries = h.feed.len();
    h.set_stream_expired(a);
    assert!(!status(&h).is_routable() && !is_live(live_in_feed(&h)));
    assert_eq!(h.feed.len(), entries + 1);
    // Back: reconnecting clears the expiry.
    h.set_connected(a, true);
    assert!(status(&h).is_routable() && !status(&h).stream_expired);
    // An expiry never applies to a stream that never connected.
    let Registered::New(b) = h.register(reg("b", "tcp://10.0.0.6:5557")).unwrap() else {
        panic!()
    };
    h.set_stream_expired(b);
    assert!(h.worker(b).unwrap().status.is_routable());
}
