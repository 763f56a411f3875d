//! Tests of the in-flight load table: counts, growth, the booking over a decision's read,
//! the prefill backlog and the learned rate, leak repair.

use super::*;

fn delta(requests: i32, prefill_tokens: i64, decode_tokens: i64) -> LoadDelta {
    LoadDelta {
        requests,
        prefill_tokens,
        decode_tokens,
        rate: RateNote::Keep,
    }
}

fn counts(requests: u32, prefill_tokens: u32, decode_tokens: u32) -> Load {
    Load::booked(requests, prefill_tokens, decode_tokens)
}

#[test]
fn load_counts_saturate_and_expire() {
    let store = MemStore::new();
    let keys = Keys::new("t");
    load_update(
        &store,
        &keys,
        8,
        LoadId::slot(2),
        delta(1, 100, 256),
        0,
        1000,
    )
    .unwrap();
    load_update(
        &store,
        &keys,
        8,
        LoadId::slot(2),
        delta(1, 50, 16),
        10,
        1000,
    )
    .unwrap();
    load_update(&store, &keys, 8, LoadId::slot(10), delta(1, 5, 0), 10, 1000).unwrap();
    let t = store.get(keys.load()).unwrap().0.unwrap();
    assert_eq!(load_get(&t, LoadId::slot(2), 20, 1000), counts(2, 150, 272));
    assert_eq!(load_get(&t, LoadId::slot(10), 20, 1000), counts(1, 5, 0));
    assert_eq!(
        load_get(&t, LoadId::slot(2), 2000, 1000),
        Load::default(),
        "expired"
    );
    let mut live = load_entries(&t, 20, 1000);
    live.sort_by_key(|e| e.0.get());
    assert_eq!(
        live.iter()
            .map(|e| (e.0.as_slot(), e.1))
            .collect::<Vec<_>>(),
        [(Some(2), counts(2, 150, 272)), (Some(10), counts(1, 5, 0))]
    );
    // Prefill released alone (first response bytes): decode stays booked.
    load_update(
        &store,
        &keys,
        8,
        LoadId::slot(2),
        delta(0, -100, 0),
        30,
        1000,
    )
    .unwrap();
    let t = store.get(keys.load()).unwrap().0.unwrap();
    assert_eq!(load_get(&t, LoadId::slot(2), 30, 1000), counts(2, 50, 272));
    load_update(
        &store,
        &keys,
        8,
        LoadId::slot(2),
        delta(-5, -1000, -1000),
        30,
        1000,
    )
    .unwrap();
    let t = store.get(keys.load()).unwrap().0.unwrap();
    assert_eq!(load_get(&t, LoadId::slot(2), 30, 1000), Load::default());
    assert_eq!(t.len(), 1 + 8 * 40, "eight entries of 40 bytes");
    assert_eq!(LoadId::instance("x").as_slot(), None);
}

#[test]
fn the_load_table_grows_with_its_ids_and_keeps_their_counts_and_rates() {
    let mut t = Vec::new();
    let rate = |r| LoadDelta {
        rate: RateNote::Set(r),
        ..delta(1, 10, 0)
    };
    for s in 0..12 {
        assert!(load_add(
            &mut t,
            256,
            LoadId::slot(s),
            rate(1000 + s),
            0,
            10_000
        ));
    }
    assert_eq!(t.len(), 1 + 16 * 40, "12 ids fit the 16 first entries");
    assert!(load_add(
        &mut t,
        256,
        LoadId::slot(12),
        rate(2000),
        0,
        10_000
    ));
    assert_eq!(
        t.len(),
        1 + 32 * 40,
        "the 13th fills it beyond 3/4: doubled"
    );
    for s in 0..13 {
        assert_eq!(load_get(&t, LoadId::slot(s), 0, 10_000), counts(1, 10, 0));
    }
    assert_eq!(
        load_rate(&t, LoadId::slot(5)),
        1005,
        "rates move with their entries"
    );
    // Idle ids keep their entry (and rate) while the table can still grow.
    assert!(load_add(
        &mut t,
        256,
        LoadId::slot(5),
        delta(-1, -10, 0),
        0,
        10_000
    ));
    for s in 13..40 {
        assert!(load_add(
            &mut t,
            256,
            LoadId::slot(s),
            delta(1, 1, 0),
            0,
            10_000
        ));
    }
    assert_eq!(t.len(), 1 + 64 * 40);
    assert_eq!(load_rate(&t, LoadId::slot(5)), 1005);
    // The capacity bounds it: 20 busy ids in at most 16 entries.
    let mut small = Vec::new();
    for s in 0..16 {
        assert!(load_add(
            &mut small,
            16,
            LoadId::slot(s),
            delta(1, 1, 0),
            0,
            10_000
        ));
    }
    assert!(
        !load_add(&mut small, 16, LoadId::slot(16), delta(1, 1, 0), 0, 10_000),
        "full"
    );
    assert_eq!(small.len(), 1 + 16 * 40);
    // A larger capacity (the configuration grew) lets the full table double.
    assert!(load_add(
        &mut small,
        256,
        LoadId::slot(16),
        delta(1, 1, 0),
        0,
        10_000
    ));
    assert_eq!(small.len(), 1 + 32 * 40);
    assert_eq!(load_entries(&small, 0, 10_000).len(), 17);
    // A table larger than the capacity (the configuration shrank) restarts at the new size.
    assert!(load_add(
        &mut t,
        8,
        LoadId::slot(1),
        delta(1, 1, 0),
        0,
        10_000
    ));
    assert_eq!(t.len(), 1 + 8 * 40);
}

#[test]
fn a_booking_over_the_decisions_read_never_loses_a_write_made_since() {
    let store = MemStore::new();
    let keys = Keys::new("t");
    let (a, b) = (LoadId::slot(0), LoadId::slot(1));
    load_update(&store, &keys, 8, a, delta(1, 10, 0), 0, 1000).unwrap();
    let (seen, cas) = store.get(keys.load()).unwrap();
    let seen = seen.unwrap();
    // Nobody wrote since the read: one write, on top of what was read.
    let reads = store.reads();
    assert!(load_update_seen(
        &store,
        &keys,
        Some((seen.clone(), cas)),
        8,
        b,
        delta(1, 5, 0),
        1,
        1000
    )
    .unwrap());
    assert_eq!(store.reads(), reads, "no second read");
    let t = store.get(keys.load()).unwrap().0.unwrap();
    assert_eq!(load_get(&t, a, 1, 1000), counts(1, 10, 0));
    assert_eq!(load_get(&t, b, 1, 1000), counts(1, 5, 0));
    // Another VM wrote since (b's booking): the stale read is dropped, nothing is lost.
    assert!(load_update_seen(
        &store,
        &keys,
        Some((seen, cas)),
        8,
        a,
        delta(1, 1, 0),
        2,
        1000
    )
    .unwrap());
    let t = store.get(keys.load()).unwrap().0.unwrap();
    assert_eq!(load_get(&t, a, 2, 1000), counts(2, 11, 0));
    assert_eq!(
        load_get(&t, b, 2, 1000),
        counts(1, 5, 0),
        "b's booking kept"
    );
    // No table was seen (token 0): read and written as usual.
    assert!(load_update_seen(
        &store,
        &keys,
        Some((Vec::new(), 0)),
        8,
        b,
        delta(-1, -5, 0),
        3,
        1000
    )
    .unwrap());
    let t = store.get(keys.load()).unwrap().0.unwrap();
    assert_eq!(load_get(&t, b, 3, 1000), Load::default());
    assert_eq!(load_get(&t, a, 3, 1000), counts(2, 11, 0));
}

#[test]
fn an_old_load_table_is_rebuilt_not_misread() {
    // A table of the previous layout (24-byte entries, first byte LAYOUT_VERSION).
    let mut old = vec![LAYOUT_VERSION];
    old.resize(1 + 8 * 24, 0xff);
    assert_eq!(load_get(&old, LoadId::slot(1), 0, 1000), Load::default());
    assert!(load_entries(&old, 0, 1000).is_empty());
    assert!(load_add(
        &mut old,
        8,
        LoadId::slot(1),
        delta(1, 2, 3),
        0,
        1000
    ));
    assert_eq!(load_get(&old, LoadId::slot(1), 0, 1000), counts(1, 2, 3));
}

#[test]
fn the_backlog_drains_at_the_rate_and_never_exceeds_the_booked_prefill() {
    let mut t = Vec::new();
    let id = LoadId::slot(1);
    let set = |r| LoadDelta {
        rate: RateNote::Set(r),
        ..delta(1, 10_000, 0)
    };
    // 10,000 tokens at 1,000 tokens/s, booked at 0 ms.
    assert!(load_add(&mut t, 8, id, set(1000), 0, 60_000));
    assert_eq!(load_get(&t, id, 0, 60_000).backlog, 10_000);
    let l = load_get(&t, id, 4_000, 60_000);
    assert_eq!(
        (l.prefill_tokens, l.backlog),
        (10_000, 6_000),
        "4 s drained 4,000"
    );
    // A second request joins the end of what is left.
    assert!(load_add(&mut t, 8, id, delta(1, 5_000, 0), 4_000, 60_000));
    assert_eq!(load_get(&t, id, 4_000, 60_000).backlog, 11_000);
    assert_eq!(load_get(&t, id, 9_000, 60_000).backlog, 6_000);
    // The first one's first bytes (late: the engine is slower than the rate): what is left
    // can be no more than the second request's 5,000.
    assert!(load_add(&mut t, 8, id, delta(0, -10_000, 0), 9_000, 60_000));
    let l = load_get(&t, id, 9_000, 60_000);
    assert_eq!((l.prefill_tokens, l.backlog), (5_000, 5_000));
    assert_eq!(load_get(&t, id, 20_000, 60_000).backlog, 0, "drained empty");
    assert_eq!(load_get(&t, id, 20_000, 60_000).prefill_tokens, 5_000);
    // Rate 0: no drain.
    assert!(load_add(&mut t, 8, id, set(0), 20_000, 60_000));
    assert_eq!(load_get(&t, id, 50_000, 60_000).backlog, 10_000);
    assert_eq!(load_rate(&t, id), 0);
}

#[test]
fn the_rate_is_learned_from_samples_and_survives_a_cleared_entry() {
    let mut t = Vec::new();
    let id = LoadId::slot(3);
    let sample = |s| LoadDelta {
        rate: RateNote::Sample(s),
        ..LoadDelta::default()
    };
    assert!(load_add(&mut t, 8, id, delta(1, 100, 0), 0, 10_000));
    assert!(load_add(&mut t, 8, id, sample(8_000), 10, 10_000));
    assert_eq!(load_rate(&t, id), 8_000, "the first sample is the rate");
    assert!(load_add(&mut t, 8, id, sample(4_000), 20, 10_000));
    assert_eq!(load_rate(&t, id), 7_000, "then a quarter weight each");
    assert!(load_clear_stale(&mut t, id, 500));
    assert_eq!(load_rate(&t, id), 7_000);
    assert_eq!(drain(1_000, 7_000, 100), 300);
    assert_eq!(drain(1_000, u32::MAX, u64::MAX), 0);
    assert_eq!(learn_rate(0, 5), 5);
    // A sample far above the rate counts as twice the rate: one raises it by a quarter...
    assert_eq!(learn_rate(190_000, 11_231_083), 237_500);
    assert_eq!(
        learn_rate(190_000, 300_000),
        217_500,
        "under the cap: as it is"
    );
    // ... and lowering it is not capped.
    assert_eq!(learn_rate(200_000, 20_000), 155_000);
    assert_eq!(learn_rate(u32::MAX, u32::MAX), u32::MAX, "no overflow");
    assert_eq!(rate_sample(RATE_SAMPLE_MIN_TOKENS, 0), None);
    assert_eq!(
        rate_sample(RATE_SAMPLE_MIN_TOKENS - 1, 10),
        None,
        "mostly overhead"
    );
    assert_eq!(rate_sample(8_000, 400), Some(20_000));
}

#[test]
fn leaked_counts_are_cleared_only_when_older_than_the_cut() {
    let mut t = Vec::new();
    assert!(load_add(
        &mut t,
        8,
        LoadId::slot(1),
        delta(2, 10, 10),
        100,
        10_000
    ));
    assert!(load_add(
        &mut t,
        8,
        LoadId::slot(2),
        delta(1, 10, 10),
        900,
        10_000
    ));
    assert!(load_clear_stale(&mut t, LoadId::slot(1), 500));
    assert!(
        !load_clear_stale(&mut t, LoadId::slot(2), 500),
        "booked after the cut"
    );
    assert!(!load_clear_stale(&mut t, LoadId::slot(3), 500), "absent");
    assert!(
        !load_clear_stale(&mut t, LoadId::slot(1), 2000),
        "already zero: nothing to repair"
    );
    assert_eq!(load_get(&t, LoadId::slot(1), 1000, 10_000), Load::default());
    assert_eq!(
        load_get(&t, LoadId::slot(2), 1000, 10_000),
        counts(1, 10, 10)
    );
}
