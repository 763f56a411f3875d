use kvroute::event::{Tier, WorkerId};
use kvroute::feed::Op;
use kvroute::scope::BlockKey;
use serde_json::json;

use crate::common::*;

const BUCKETS: usize = 1024;

#[test]
fn a_million_blocks_churn_through_a_fixed_keyspace() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "default", "m", None, None);
    let mut gw = gateway(&config(json!({"index": {"buckets": BUCKETS}})), 2);
    feed.attach(&mut gw);
    sync(&mut gw);
    let bound = 7 + 2 * (1 + BUCKETS);
    let mut counts = Vec::new();
    let per_round = 50_000u64;
    let mut churned = 0u64;
    for round in 0..20u64 {
        let keys: Vec<BlockKey> = (0..per_round)
            .map(|i| BlockKey((round * per_round + i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        let worker = WorkerId((round % 2) as u32);
        feed.push(Op::Blocks {
            worker,
            tier: Tier::Gpu,
            added: true,
            keys: keys.clone(),
        });
        sync(&mut gw);
        counts.push(gw.shared_data_len());
        feed.push(Op::Blocks {
            worker,
            tier: Tier::Gpu,
            added: false,
            keys,
        });
        sync(&mut gw);
        counts.push(gw.shared_data_len());
        churned += per_round;
    }
    assert_eq!(churned, 1_000_000);
    eprintln!(
        "shared-data keys while churning 1M blocks: {:?} (bound {bound})",
        &counts[..4]
    );
    assert!(
        counts.iter().all(|&c| c == counts[0]),
        "key count constant: {counts:?}"
    );
    assert!(counts[0] <= bound, "{} keys > {bound}", counts[0]);
    // Everything churned is gone again; what stays still routes.
    assert!(
        gw.shared_data_bytes() < 64 * 1024 + bound * 64,
        "{} bytes",
        gw.shared_data_bytes()
    );
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
    assert!(gw.errors().is_empty());
}
