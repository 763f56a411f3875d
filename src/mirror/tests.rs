//! Tests of the mirror as a whole: pages applied to a [`MemStore`] and read back.

use super::*;
use crate::event::{Tier, WorkerId};
use crate::feed::{Op, Page};
use crate::lookup::{longest_matches, WalkStats};
use crate::lookup::{HolderView, TierMask};
use crate::scope::BlockKey;
use proptest::prelude::*;
use std::collections::BTreeMap;

fn limits(bits: u8) -> Limits {
    Limits {
        buckets_log2: bits,
        max_workers: 64,
        max_bucket_keys: 4096,
        max_models: 16,
    }
}

fn worker(id: u32, inst: &str, dp: u32) -> Op {
    Op::Worker {
        id: WorkerId(id),
        live: true,
        dp_rank: dp,
        instance_id: inst.into(),
        address: format!("10.0.0.{id}:8000"),
        tenant: "default".into(),
        model: "m".into(),
    }
}

fn blocks(w: u32, tier: Tier, added: bool, keys: &[u64]) -> Op {
    Op::Blocks {
        worker: WorkerId(w),
        tier,
        added,
        keys: keys.iter().map(|&k| BlockKey(k)).collect(),
    }
}

fn page(flags: u8, epoch: u64, cursor: u64, ops: Vec<Op>) -> Page {
    Page {
        flags,
        epoch,
        cursor,
        ops,
    }
}

fn holders(store: &MemStore, keys: &Keys, l: &Limits, k: u64) -> Vec<(WorkerId, TierMask)> {
    let (state, _) = read_state(store, keys).unwrap();
    let view = BucketView::new(store, keys, &state, l.buckets_log2);
    let mut out = Vec::new();
    view.holders(BlockKey(k), &mut out);
    out
}

#[test]
fn bucket_round_trips_and_finds_keys() {
    let mut rows = BucketRows::default();
    assert!(rows.add(BlockKey(5), 1, Tier::Gpu, 10));
    assert!(rows.add(BlockKey(5), 0, Tier::Cpu, 10));
    assert!(rows.add(BlockKey(3), 2, Tier::Disk, 10));
    assert!(rows.add(BlockKey(5), 1, Tier::Cpu, 10));
    let mut v = Vec::new();
    rows.encode(7, &mut v);
    assert!(
        BucketRef::parse(&v, 8).is_none(),
        "another build's bucket reads as empty"
    );
    let b = BucketRef::parse(&v, 7).unwrap();
    assert_eq!(b.len(), 2);
    let mut out = Vec::new();
    b.holders_into(BlockKey(5), &mut out);
    assert_eq!(
        out,
        vec![(WorkerId(0), TierMask(2)), (WorkerId(1), TierMask(3))]
    );
    out.clear();
    b.holders_into(BlockKey(4), &mut out);
    assert!(out.is_empty());
    assert_eq!(BucketRows::from_ref(Some(b)), rows);
    rows.remove(BlockKey(5), 1, Tier::Gpu);
    rows.remove(BlockKey(5), 1, Tier::Cpu);
    rows.remove(BlockKey(5), 0, Tier::Cpu);
    assert_eq!(rows.keys(), 1);
}

#[test]
fn prefix_view_hashes_lazily_and_matches_the_eager_walk() {
    let store = MemStore::new();
    let keys = Keys::new("t");
    let l = limits(8);
    let tokens: Vec<u32> = (0..16 * 64).collect();
    let scope = crate::scope::ScopeId::of("default", "m", None, None);
    let seqs = crate::hash::sequence_hashes(&tokens, 16, crate::hash::seed(None, None)).unwrap();
    let bkeys: Vec<u64> = seqs.iter().map(|s| scope.key(*s).0).collect();
    let ops = vec![
        worker(0, "a", 0),
        worker(1, "b", 0),
        blocks(0, Tier::Gpu, true, &bkeys[..40]),
        blocks(1, Tier::Gpu, true, &bkeys[..7]),
    ];
    apply_page(&store, &keys, &l, &page(Page::RESET, 1, 1, ops), 0).unwrap();
    let (st, _) = read_state(&store, &keys).unwrap();
    let eager: Vec<BlockKey> = bkeys.iter().map(|&k| BlockKey(k)).collect();
    let want = longest_matches(
        &BucketView::new(&store, &keys, &st, l.buckets_log2),
        &eager,
        &mut WalkStats::default(),
    );
    let view = PrefixView::new(
        BucketView::new(&store, &keys, &st, l.buckets_log2),
        &tokens,
        16,
        crate::hash::seed(None, None),
        scope,
        Vec::new(),
    );
    let mut depths = Vec::new();
    depth_keys(view.blocks(), &mut depths);
    let got = longest_matches(&view, &depths, &mut WalkStats::default());
    assert_eq!(got, want);
    assert!(view.hashed() < 64, "hashed {} of 64 blocks", view.hashed());
    // Nobody holds the first block of another prompt: one block hashed.
    let other: Vec<u32> = (5000..5000 + 16 * 64).collect();
    let view = PrefixView::new(
        BucketView::new(&store, &keys, &st, l.buckets_log2),
        &other,
        16,
        crate::hash::seed(None, None),
        scope,
        Vec::new(),
    );
    assert!(longest_matches(&view, &depths, &mut WalkStats::default()).is_empty());
    assert_eq!(view.hashed(), 1);
    depth_keys(3, &mut depths);
    assert_eq!(depths, vec![Depth(0), Depth(1), Depth(2)]);
}

#[test]
fn bucket_keys_are_hex() {
    let k = Keys::new("p");
    assert_eq!(k.bucket(0, 0), "kvroute/p/v3/g0/b0");
    assert_eq!(k.bucket(1, 0x3fff), "kvroute/p/v3/g1/b3fff");
    assert_eq!(k.bucket(2, 16), "kvroute/p/v3/g0/b10");
}

#[test]
fn fixed_keys_and_speculative_shards_are_named_as_ever() {
    let k = Keys::new("p");
    assert_eq!(k.active(), "kvroute/p/v3/active");
    assert_eq!(k.load(), "kvroute/p/v3/load");
    assert_eq!(k.meta(3), "kvroute/p/v3/g1/meta");
    for shard in [0, 7, 10, 99, 100, 4_095, u32::MAX] {
        assert_eq!(k.speculative(shard), format!("kvroute/p/v3/spec/{shard}"));
    }
}

#[test]
fn full_bucket_drops_new_keys_only() {
    let mut rows = BucketRows::default();
    assert!(rows.add(BlockKey(1), 0, Tier::Gpu, 2));
    assert!(rows.add(BlockKey(2), 0, Tier::Gpu, 2));
    assert!(!rows.add(BlockKey(3), 0, Tier::Gpu, 2));
    assert!(
        rows.add(BlockKey(2), 1, Tier::Gpu, 2),
        "a new holder of a kept key still fits"
    );
}

#[test]
fn damaged_values_never_panic() {
    for len in 0..40 {
        let v: Vec<u8> = (0..len).map(|i| (i * 37 + 1) as u8).collect();
        let _ = BucketRef::parse(&v, 0);
        let _ = Meta::decode(&v, 0);
        let _ = SyncState::decode(&v);
        let _ = Lease::decode(&v);
        let _ = load_get(&v, LoadId::slot(0), 0, 10);
    }
}

#[test]
fn reset_builds_aside_and_switches_whole() {
    let store = MemStore::new();
    let keys = Keys::new("t");
    let l = limits(4);
    assert_eq!(
        apply_page(&store, &keys, &l, &page(0, 1, 1, vec![]), 0),
        Err(SyncError::NoBase)
    );
    let p1 = page(
        Page::RESET | Page::MORE,
        1,
        10,
        vec![worker(0, "a", 0), blocks(0, Tier::Gpu, true, &[1 << 60])],
    );
    let a = apply_page(&store, &keys, &l, &p1, 5).unwrap();
    assert!(!a.switched && a.more);
    assert!(
        read_state(&store, &keys).unwrap().0.is_stale(5, 1000),
        "nothing switched in yet"
    );
    assert!(holders(&store, &keys, &l, 1 << 60).is_empty());
    let a = apply_page(
        &store,
        &keys,
        &l,
        &page(0, 1, 11, vec![blocks(0, Tier::Gpu, true, &[2 << 60])]),
        6,
    )
    .unwrap();
    assert!(a.switched);
    let (st, _) = read_state(&store, &keys).unwrap();
    assert!(!st.is_stale(6, 1000));
    assert_eq!(st.feed_query(), "?v=4&epoch=1&since=11");
    assert_eq!(
        holders(&store, &keys, &l, 1 << 60),
        vec![(WorkerId(0), TierMask(1))]
    );
    // A new snapshot goes to the other generation; readers keep the old one meanwhile.
    apply_page(
        &store,
        &keys,
        &l,
        &page(Page::RESET | Page::MORE, 2, 1, vec![worker(0, "a", 0)]),
        7,
    )
    .unwrap();
    assert_eq!(
        holders(&store, &keys, &l, 1 << 60),
        vec![(WorkerId(0), TierMask(1))]
    );
    assert!(read_state(&store, &keys)
        .unwrap()
        .0
        .feed_query()
        .starts_with("?v=4&epoch=2&since=1"));
    apply_page(&store, &keys, &l, &page(0, 2, 2, vec![]), 8).unwrap();
    assert!(
        holders(&store, &keys, &l, 1 << 60).is_empty(),
        "the old build's blocks are gone"
    );
    // A delta of another epoch drops the cursor so the next pull asks for a snapshot.
    assert!(matches!(
        apply_page(&store, &keys, &l, &page(0, 9, 3, vec![]), 9),
        Err(SyncError::EpochMismatch { got: 9, want: 2 })
    ));
    assert_eq!(read_state(&store, &keys).unwrap().0.feed_query(), "?v=4");
}

fn mark(seq: u64) -> Op {
    Op::Stream(crate::feed::StreamMark { stream: 77, seq })
}

/// A reader that followed replica A (epoch 1) of stream 77 up to its sequence 40.
fn follower_of_a() -> (MemStore, Keys, Limits) {
    let store = MemStore::new();
    let keys = Keys::new("t");
    let l = limits(4);
    let snap = page(
        Page::RESET,
        1,
        100,
        vec![
            worker(0, "a", 0),
            worker(2, "c", 0),
            blocks(0, Tier::Gpu, true, &[1 << 60]),
            mark(40),
        ],
    );
    assert!(apply_page(&store, &keys, &l, &snap, 5).unwrap().switched);
    let (st, _) = read_state(&store, &keys).unwrap();
    assert_eq!(st.feed_query(), "?v=4&epoch=1&since=100&stream=77&seq=40");
    (store, keys, l)
}

#[test]
fn a_replica_of_the_same_stream_takes_over_without_a_snapshot() {
    let (store, keys, l) = follower_of_a();
    let mut dead = worker(2, "c", 0);
    if let Op::Worker { live, .. } = &mut dead {
        *live = false;
    }
    let handover = page(
        Page::HANDOVER,
        2,
        7,
        vec![worker(0, "a", 0), dead, mark(40)],
    );
    let a = apply_page(&store, &keys, &l, &handover, 6).unwrap();
    assert!(a.handover && !a.switched);
    let (st, _) = read_state(&store, &keys).unwrap();
    assert_eq!((st.epoch, st.cursor, st.cursor_valid), (2, 7, true));
    assert!(st.build.is_none() && !st.is_stale(6, 1000));
    // The blocks held stay; the table took the new replica's liveness.
    assert_eq!(
        holders(&store, &keys, &l, 1 << 60),
        vec![(WorkerId(0), TierMask(1))]
    );
    let meta = Meta::decode(&store.get(keys.meta(st.gen)).unwrap().0.unwrap(), st.stamp);
    assert!(!meta.unwrap().workers[2].as_ref().unwrap().live);
    // Its deltas follow, in its epoch.
    let next = page(
        0,
        2,
        9,
        vec![blocks(2, Tier::Gpu, true, &[2 << 60]), mark(41)],
    );
    apply_page(&store, &keys, &l, &next, 7).unwrap();
    assert_eq!(
        read_state(&store, &keys).unwrap().0.feed_query(),
        "?v=4&epoch=2&since=9&stream=77&seq=41"
    );
}

#[test]
fn a_handover_with_another_table_or_position_falls_back_to_a_snapshot() {
    let cases: [(&str, Vec<Op>); 4] = [
        (
            "another worker in a slot",
            vec![worker(0, "a", 0), worker(2, "x", 0), mark(40)],
        ),
        (
            "a slot the reader does not hold",
            vec![
                worker(0, "a", 0),
                worker(2, "c", 0),
                worker(3, "d", 0),
                mark(40),
            ],
        ),
        ("a slot missing", vec![worker(0, "a", 0), mark(40)]),
        (
            "another position",
            vec![worker(0, "a", 0), worker(2, "c", 0), mark(39)],
        ),
    ];
    for (what, ops) in cases {
        let (store, keys, l) = follower_of_a();
        let r = apply_page(&store, &keys, &l, &page(Page::HANDOVER, 2, 7, ops), 6);
        assert!(
            matches!(r, Err(SyncError::HandoverRefused(_))),
            "{what}: {r:?}"
        );
        let (st, _) = read_state(&store, &keys).unwrap();
        assert_eq!(
            st.feed_query(),
            "?v=4",
            "{what}: the next pull asks for a snapshot"
        );
        assert_eq!(st.epoch, 1, "{what}: nothing of the page was taken");
        assert_eq!(
            holders(&store, &keys, &l, 1 << 60),
            vec![(WorkerId(0), TierMask(1))],
            "{what}: the index held still serves until the snapshot is in"
        );
    }
    // A page with no mark (a collector not on a stream) leaves nothing to hand over.
    let (store, keys, l) = follower_of_a();
    apply_page(&store, &keys, &l, &page(0, 1, 101, vec![]), 6).unwrap();
    assert_eq!(
        read_state(&store, &keys).unwrap().0.feed_query(),
        "?v=4&epoch=1&since=101"
    );
}

#[test]
fn meta_tracks_workers_sizes_and_aliases() {
    let store = MemStore::new();
    let keys = Keys::new("t");
    let l = limits(2);
    let ops = vec![
        worker(3, "inst", 1),
        worker(99, "too-far", 0),
        Op::BlockSize {
            tenant: "default".into(),
            model: "m".into(),
            block_size: 16,
        },
        Op::Alias {
            tenant: "default".into(),
            served: "ad".into(),
            model: "m".into(),
            lora: Some("ad".into()),
        },
    ];
    let a = apply_page(&store, &keys, &l, &page(Page::RESET, 1, 1, ops), 0).unwrap();
    assert_eq!(a.stats.bad_workers, 1);
    let (st, _) = read_state(&store, &keys).unwrap();
    let meta = Meta::decode(&store.get(keys.meta(st.gen)).unwrap().0.unwrap(), st.stamp).unwrap();
    assert_eq!(meta.worker(3).unwrap().dp_rank, 1);
    assert_eq!(meta.block_size("default", "m"), Some(16));
    assert_eq!(meta.resolve("default", "ad"), ("m", Some("ad")));
    assert_eq!(meta.resolve("default", "m"), ("m", None));
    let v = st.meta_version;
    apply_page(
        &store,
        &keys,
        &l,
        &page(0, 1, 2, vec![Op::WorkerGone { id: WorkerId(3) }]),
        1,
    )
    .unwrap();
    let (st, _) = read_state(&store, &keys).unwrap();
    assert_ne!(st.meta_version, v);
    let meta = Meta::decode(&store.get(keys.meta(st.gen)).unwrap().0.unwrap(), st.stamp).unwrap();
    assert!(meta.worker(3).is_none());
}

#[test]
fn lease_is_exclusive_until_it_lapses() {
    let store = MemStore::new();
    let keys = Keys::new("t");
    assert!(acquire_lease(&store, &keys, 1, 0, 100).unwrap());
    assert!(!acquire_lease(&store, &keys, 2, 50, 100).unwrap());
    assert!(acquire_lease(&store, &keys, 1, 60, 100).unwrap());
    assert!(!acquire_lease(&store, &keys, 2, 150, 100).unwrap());
    assert!(acquire_lease(&store, &keys, 2, 161, 100).unwrap());
    assert_eq!(next_vm_id(&store, &keys), Ok(1));
    assert_eq!(next_vm_id(&store, &keys), Ok(2));
}

#[test]
fn churning_a_million_blocks_keeps_the_keyspace_fixed() {
    let store = MemStore::new();
    let keys = Keys::new("t");
    let l = limits(10);
    apply_page(
        &store,
        &keys,
        &l,
        &page(
            Page::RESET,
            1,
            0,
            vec![worker(0, "a", 0), worker(1, "b", 0)],
        ),
        0,
    )
    .unwrap();
    let base = store.key_count();
    let mut cursor = 0;
    let mut seen_max = 0;
    for chunk in 0..20u64 {
        let ks: Vec<u64> = (0..50_000u64)
            .map(|i| (chunk * 50_000 + i).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        cursor += 1;
        apply_page(
            &store,
            &keys,
            &l,
            &page(
                0,
                1,
                cursor,
                vec![blocks((chunk % 2) as u32, Tier::Gpu, true, &ks)],
            ),
            cursor,
        )
        .unwrap();
        seen_max = seen_max.max(store.key_count());
        cursor += 1;
        apply_page(
            &store,
            &keys,
            &l,
            &page(
                0,
                1,
                cursor,
                vec![blocks((chunk % 2) as u32, Tier::Gpu, false, &ks)],
            ),
            cursor,
        )
        .unwrap();
    }
    let fixed = 7 + 2 * (1 + l.buckets() as usize);
    assert!(seen_max <= fixed, "{seen_max} keys > {fixed}");
    assert!(store.key_count() <= fixed);
    assert!(base <= store.key_count());
    // Everything removed: buckets are empty again.
    assert!(store.value_bytes() < fixed * 64);
}

/// Naive model: BTreeMap of (key, slot) → mask.
#[derive(Debug, Clone)]
enum TOp {
    Add(u8, u8, u8),
    Remove(u8, u8, u8),
    Gone(u8),
}

fn arb_op() -> impl Strategy<Value = TOp> {
    prop_oneof![
        (0u8..12, 0u8..4, 0u8..3).prop_map(|(k, w, t)| TOp::Add(k, w, t)),
        (0u8..12, 0u8..4, 0u8..3).prop_map(|(k, w, t)| TOp::Remove(k, w, t)),
        (0u8..4).prop_map(TOp::Gone),
    ]
}

proptest! {
    #[test]
    fn buckets_agree_with_a_naive_map(ops in proptest::collection::vec(arb_op(), 1..60)) {
        let store = MemStore::new();
        let keys = Keys::new("p");
        let l = limits(1);
        let workers: Vec<Op> = (0..4).map(|w| worker(w, "i", 0)).collect();
        apply_page(&store, &keys, &l, &page(Page::RESET, 1, 0, workers), 0).unwrap();
        let mut model: BTreeMap<(u64, u16), u8> = BTreeMap::new();
        // Keys spread over both buckets, small key space so collisions happen.
        let key = |k: u8| (k as u64) << 60 | k as u64;
        for (n, op) in ops.iter().enumerate() {
            let p = match op {
                TOp::Add(k, w, t) => {
                    *model.entry((key(*k), *w as u16)).or_default() |= 1 << t;
                    blocks(*w as u32, Tier::from_u8(*t).unwrap(), true, &[key(*k)])
                }
                TOp::Remove(k, w, t) => {
                    if let Some(m) = model.get_mut(&(key(*k), *w as u16)) {
                        *m &= !(1 << t);
                        if *m == 0 { model.remove(&(key(*k), *w as u16)); }
                    }
                    blocks(*w as u32, Tier::from_u8(*t).unwrap(), false, &[key(*k)])
                }
                TOp::Gone(w) => {
                    // The feed sends removals before WorkerGone: mimic it.
                    let held: Vec<(u64, u8)> = model.iter().filter(|((_, s), _)| *s == *w as u16).map(|((k, _), m)| (*k, *m)).collect();
                    let mut ops = Vec::new();
                    for (k, m) in held {
                        for t in 0..3u8 {
                            if m & (1 << t) != 0 { ops.push(blocks(*w as u32, Tier::from_u8(t).unwrap(), false, &[k])); }
                        }
                        model.remove(&(k, *w as u16));
                    }
                    ops.push(Op::WorkerGone { id: WorkerId(*w as u32) });
                    ops.push(worker(*w as u32, "i", 0));
                    apply_page(&store, &keys, &l, &page(0, 1, n as u64 + 1, ops), 0).unwrap();
                    continue;
                }
            };
            apply_page(&store, &keys, &l, &page(0, 1, n as u64 + 1, vec![p]), 0).unwrap();
            for k in 0..12u8 {
                let got = holders(&store, &keys, &l, key(k));
                let want: Vec<(WorkerId, TierMask)> = model.range((key(k), 0)..=(key(k), u16::MAX)).map(|((_, s), m)| (WorkerId(*s as u32), TierMask(*m))).collect();
                prop_assert_eq!(got, want);
            }
        }
    }
}

#[test]
fn view_walk_reads_grow_with_log_depth() {
    let store = MemStore::new();
    let keys = Keys::new("t");
    let l = limits(12);
    let chain: Vec<u64> = (1..=4096u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let ops = vec![
        worker(0, "a", 0),
        worker(1, "b", 0),
        blocks(0, Tier::Gpu, true, &chain),
        blocks(1, Tier::Cpu, true, &chain[..1000]),
    ];
    apply_page(&store, &keys, &l, &page(Page::RESET, 1, 1, ops), 0).unwrap();
    let (st, _) = read_state(&store, &keys).unwrap();
    let view = BucketView::new(&store, &keys, &st, l.buckets_log2);
    let q: Vec<BlockKey> = chain.iter().map(|&k| BlockKey(k)).collect();
    let mut stats = WalkStats::default();
    let m = longest_matches(&view, &q, &mut stats);
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].blocks, [4096, 4096, 4096]);
    assert_eq!(m[1].blocks, [0, 1000, 1000]);
    assert!(view.reads() <= 40, "{} reads", view.reads());
}

#[test]
fn the_fleet_value_round_trips_and_takes_pages_as_the_whole_picture() {
    use crate::feed::EngineSample;
    let c = |requests, prefill_tokens, decode_tokens| Counts {
        requests,
        prefill_tokens,
        decode_tokens,
    };
    let load = |w: u32, n: u64, engine: Option<EngineSample>| Op::Load {
        worker: WorkerId(w),
        requests: n,
        prefill_tokens: n * 100,
        decode_tokens: n * 10,
        engine,
    };
    let idle = EngineSample {
        load: crate::router::EngineLoad {
            kv_permille: 120,
            ..Default::default()
        },
        age_ms: 40,
        ..EngineSample::default()
    };
    let mut f = Fleet::default();
    assert!(
        !f.apply_ops(&[Op::WorkerGone { id: WorkerId(0) }], 8, 5),
        "no Load op"
    );
    assert!(f.apply_ops(&[load(1, 3, Some(idle)), load(9, 1, None)], 8, 10));
    assert_eq!(f.workers.len(), 2, "slot 9 is past max_workers");
    assert_eq!(f.worker(1).total, c(3, 300, 30));
    assert_eq!(f.worker(1).idle_samples, 1);
    f.set_reported(&[(1, c(1, 100, 10)), (0, c(2, 0, 0))], 8);
    // The same scrape on the next page (10 ms later, 10 ms older): not a second sample.
    let later = EngineSample { age_ms: 50, ..idle };
    assert!(f.apply_ops(&[load(1, 3, Some(later))], 8, 20));
    assert_eq!(f.worker(1).idle_samples, 1);
    assert!(f.apply_ops(&[load(1, 4, Some(idle))], 8, 200));
    let w = f.worker(1);
    assert_eq!(
        (w.total, w.reported, w.idle_samples),
        (c(4, 400, 40), c(1, 100, 10), 2)
    );
    assert_eq!(f.worker(0).total, Counts::default(), "not named: none");
    assert_eq!(f.worker(0).reported, c(2, 0, 0), "own reports are kept");
    // A busy or stale sample resets the idle streak.
    let stale = EngineSample {
        stale: true,
        ..idle
    };
    assert!(f.apply_ops(&[load(1, 4, Some(stale))], 8, 300));
    assert_eq!(f.worker(1).idle_samples, 0);
    f.replica = Replica { index: 1, count: 3 };
    let back = Fleet::decode(&f.encode());
    assert_eq!(back, f);
    assert_eq!(back.received_ms, 300);
    assert_eq!(back.replica, Replica { index: 1, count: 3 });
    let mut older = f.encode();
    older[0] = LAYOUT_VERSION;
    assert_eq!(Fleet::decode(&older), Fleet::default(), "the older layout");
    assert_eq!(Fleet::decode(&[1, 2, 3]), Fleet::default());
    let mut cut = f.encode();
    cut.pop();
    assert_eq!(Fleet::decode(&cut), Fleet::default());
    let store = MemStore::new();
    let keys = Keys::new("t");
    update_fleet(&store, &keys, |x| {
        *x = f.clone();
        true
    })
    .unwrap();
    assert_eq!(read_fleet(&store, &keys), f);
}

#[test]
fn bucket_cache_serves_repeat_reads_until_the_index_moves() {
    let store = MemStore::new();
    let keys = Keys::new("t");
    let l = limits(4);
    let ops = vec![
        worker(0, "a", 0),
        worker(1, "b", 0),
        blocks(0, Tier::Gpu, true, &[1 << 60, 2 << 60, 3 << 60]),
        blocks(1, Tier::Gpu, true, &[1 << 60]),
    ];
    apply_page(&store, &keys, &l, &page(Page::RESET, 1, 1, ops), 0).unwrap();
    let mut cache = BucketCache::default();
    let lookup = |cache: &mut BucketCache, k: u64| {
        let (st, _) = read_state(&store, &keys).unwrap();
        let before = store.reads();
        let view = BucketView::with_cache(&store, &keys, &st, l.buckets_log2, cache);
        let mut got = Vec::new();
        view.holders(BlockKey(k), &mut got);
        let mut want = Vec::new();
        BucketView::new(&store, &keys, &st, l.buckets_log2).holders(BlockKey(k), &mut want);
        assert_eq!(got, want, "the cache reads what the store holds");
        assert_eq!(view.reads(), 1);
        (store.reads() - before - 1, view.cached())
    };
    // First read: from the store; the same bucket again (any key in it): from the cache.
    assert_eq!(lookup(&mut cache, 1 << 60), (1, 0));
    assert_eq!(lookup(&mut cache, 1 << 60), (0, 1));
    assert_eq!(
        lookup(&mut cache, (1 << 60) + 5),
        (0, 1),
        "an absent key, same bucket"
    );
    assert_eq!(
        lookup(&mut cache, 9 << 60),
        (1, 0),
        "an empty bucket is read once"
    );
    assert_eq!(lookup(&mut cache, 9 << 60), (0, 1));
    // A sync that changes nothing but the sync time keeps the entries.
    apply_page(&store, &keys, &l, &page(0, 1, 1, vec![]), 5).unwrap();
    assert_eq!(lookup(&mut cache, 1 << 60), (0, 1));
    // A page that moves the cursor drops them: the new holder is seen at once.
    let ops = vec![blocks(1, Tier::Gpu, true, &[2 << 60])];
    apply_page(&store, &keys, &l, &page(0, 1, 2, ops), 10).unwrap();
    assert_eq!(lookup(&mut cache, 2 << 60), (1, 0));
    assert_eq!(cache.len(), 1);
    // Bounded: past the limit the cache starts over.
    let (st, _) = read_state(&store, &keys).unwrap();
    let view = BucketView::with_cache(&store, &keys, &st, 16, &mut cache);
    for k in 0..=BucketCache::MAX_ENTRIES as u64 {
        view.holders(BlockKey(k << 48), &mut Vec::new());
    }
    drop(view);
    assert!(cache.len() <= BucketCache::MAX_ENTRIES);
}
