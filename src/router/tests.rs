//! The whole decision natively, through [`route`] over a [`MemStore`]: the paths the filter
//! takes (token matches, an answer mapped on the roster, text holders, remote answers), the
//! books it writes and the load the next decision reads back.

use super::*;
use crate::api::{InstanceMatch, QueryResponse};
use crate::event::WorkerId;
use crate::mirror::{Keys, MemStore, Meta, WorkerSlot};
use crate::select::SplitMix64;

const Q: Query = Query {
    blocks: 8,
    block_size: 16,
};
const PC: PictureConfig = PictureConfig {
    fresh_ms: 10_000,
    load_ttl_ms: 60_000,
    fleet_counts: true,
};

struct Fleet {
    store: MemStore,
    keys: Keys,
    roster: Roster,
}

impl Fleet {
    /// Instances `e0..e{n}` serving model `m`, one worker slot each; `other` serves model `o`.
    fn new(n: usize, other: bool) -> Fleet {
        let w = |i: usize, model: &str| {
            Some(WorkerSlot {
                live: true,
                dp_rank: 0,
                instance_id: format!("e{i}"),
                address: format!("10.0.0.{i}:8000"),
                tenant: "t".into(),
                model: model.into(),
            })
        };
        let mut workers: Vec<_> = (0..n).map(|i| w(i, "m")).collect();
        if other {
            workers.push(w(n, "o"));
        }
        Fleet {
            store: MemStore::new(),
            keys: Keys::new("test"),
            roster: Roster::from_meta(&Meta {
                workers,
                ..Meta::default()
            }),
        }
    }

    fn books(&self) -> Books<'_, MemStore> {
        Books {
            store: &self.store,
            keys: &self.keys,
            capacity: 16,
            ttl_ms: PC.load_ttl_ms,
            prefill_rate: None,
        }
    }

    fn decide(&self, matches: &[WorkerMatch], policy: &Policy, now: u64) -> (Choice, Picture) {
        let picture = Picture::read(&self.store, &self.keys, PC, now);
        let field = Field::Roster {
            roster: &self.roster,
            matches,
            tenant: "t",
            model: "m",
        };
        let c = route(field, Q, &picture, policy, &mut SplitMix64(7));
        (c, picture)
    }

    /// Decides and books, as the filter does; the target and the booking.
    fn route_and_book(&self, matches: &[WorkerMatch], now: u64) -> (Target, Booked) {
        let (c, picture) = self.decide(matches, &Policy::default(), now);
        let Verdict::Route { decision, target } = c.verdict else {
            panic!("not routed: {:?}", c.verdict);
        };
        let prefill = (Q.blocks - decision.matched_blocks) * Q.block_size;
        let b = self
            .books()
            .book(picture, target.load_id, prefill, 100, false)
            .expect("booked");
        (target, b)
    }
}

fn held(slot: u32, blocks: u32) -> WorkerMatch {
    WorkerMatch {
        worker: WorkerId(slot),
        blocks: [blocks; 3],
    }
}

#[test]
fn a_token_request_goes_to_its_prefix_and_the_runner_up_is_another_engine() {
    let f = Fleet::new(3, false);
    let (t, b) = f.route_and_book(&[held(1, 6)], 0);
    assert_eq!(
        (t.instance.as_str(), t.address.as_str()),
        ("e1", "10.0.0.1:8000")
    );
    assert_eq!(t.slot(), Some(1));
    assert!(t.runner_up.is_some() && t.runner_up.as_deref() != Some("10.0.0.1:8000"));
    assert_eq!(t.dp_rank, None, "one rank: no rank header");
    assert_eq!((b.prefill, b.decode), (2 * 16, 100));
}

#[test]
fn booked_load_steers_the_next_cold_requests_and_releases_return_it() {
    let f = Fleet::new(2, false);
    // Two cold requests: the second sees the first's booking and takes the other engine.
    let (a, ba) = f.route_and_book(&[], 0);
    let (b, bb) = f.route_and_book(&[], 1);
    assert_ne!(a.instance, b.instance, "the books of the first count");
    let p = Picture::read(&f.store, &f.keys, PC, 2);
    assert_eq!(p.load(a.load_id).requests, 1);
    assert_eq!(p.load(a.load_id).prefill_tokens, 128);
    // The first token releases the prefill, the end the request.
    let mut ba = ba;
    f.books().release_prefill(&mut ba, 3).unwrap();
    let p = Picture::read(&f.store, &f.keys, PC, 3);
    assert_eq!(
        (p.load(a.load_id).requests, p.load(a.load_id).prefill_tokens),
        (1, 0)
    );
    f.books().release(ba, 4).unwrap();
    f.books().release(bb, 4).unwrap();
    let p = Picture::read(&f.store, &f.keys, PC, 5);
    assert_eq!(p.load(a.load_id), InstanceLoad::default());
    assert_eq!(p.load(b.load_id), InstanceLoad::default());
}

#[test]
fn a_response_released_whole_leaves_the_books_as_the_two_steps_do() {
    // The same bookings released at the same times, one fleet in two steps, the other
    // whole: the load tables (every count and the learned prefill rate) are byte for byte
    // the same, and the whole release writes once.
    use crate::mirror::Store as _;
    let table = |f: &Fleet| f.store.get(f.keys.load()).unwrap().0.unwrap();
    for (idle, prefill_open) in [(true, true), (false, true), (true, false)] {
        let (two, one) = (Fleet::new(2, false), Fleet::new(2, false));
        let mut booked = Vec::new();
        for f in [&two, &one] {
            let (_, mut b) = f.route_and_book(&[], 0);
            b.measures_rate = idle;
            if !prefill_open {
                f.books().release_prefill(&mut b, 40).unwrap();
            }
            booked.push(b);
        }
        let mut b = booked[0];
        two.books().release_prefill(&mut b, 250).unwrap();
        two.books().release(b, 250).unwrap();
        let (_, cas) = one.store.get(one.keys.load()).unwrap();
        one.books().release_whole(booked[1], 250).unwrap();
        assert_eq!(
            table(&one),
            table(&two),
            "idle {idle}, prefill open {prefill_open}"
        );
        let (_, after) = one.store.get(one.keys.load()).unwrap();
        assert_eq!(after, cas + 1, "one write");
        let p = Picture::read(&one.store, &one.keys, PC, 251);
        assert_eq!(p.load(booked[1].id), InstanceLoad::default());
    }
}

#[test]
fn an_engine_kept_busy_by_hits_gets_no_cold_request() {
    // The e2e case: long requests on a prefix cached on e0 keep it busy; short cold prompts
    // must go elsewhere, whatever the tie band.
    let f = Fleet::new(2, false);
    for i in 0..3 {
        let (t, _) = f.route_and_book(&[held(0, 8)], i);
        assert_eq!(t.instance, "e0", "the hits follow their prefix");
    }
    for i in 0..5 {
        let (c, _) = f.decide(&[], &Policy::default(), 10 + i);
        let Verdict::Route { target, .. } = c.verdict else {
            panic!("cold requests are decided");
        };
        assert_eq!(target.instance, "e1");
    }
}

#[test]
fn an_answer_on_the_roster_sees_cold_engines_too() {
    // Text exact in local mode: the collector names only e2; the decision sees all three.
    let f = Fleet::new(3, false);
    let answer = QueryResponse {
        block_size: 16,
        query_blocks: 8,
        instances: [(
            "e2".to_string(),
            InstanceMatch {
                address: "10.0.0.2:8000".into(),
                gpu: 96,
                cpu: 96,
                disk: 96,
                longest_matched: 96,
                ..InstanceMatch::default()
            },
        )]
        .into_iter()
        .collect(),
    };
    let matches = answer_on_roster(&answer, &f.roster).unwrap();
    assert_eq!(matches, [held(2, 6)]);
    let (c, _) = f.decide(&matches, &Policy::default(), 0);
    assert_eq!(c.contenders.len(), 3);
    assert!(matches!(c.verdict, Verdict::Route { ref target, .. } if target.instance == "e2"));
    // An answer naming only instances the roster does not know: not synced yet.
    let unknown = QueryResponse {
        instances: [("zz".to_string(), InstanceMatch::default())]
            .into_iter()
            .collect(),
        ..answer
    };
    assert_eq!(answer_on_roster(&unknown, &f.roster), None);
}

#[test]
fn text_holders_merge_with_deeper_matches_kept() {
    // Approximate mode and the speculative table both add holders through `hold`.
    let mut m = vec![held(0, 3)];
    hold(&mut m, 0, 2);
    hold(&mut m, 1, 5);
    hold(&mut m, 0, 4);
    assert_eq!(m, [held(0, 4), held(1, 5)]);
    let f = Fleet::new(2, false);
    let (c, _) = f.decide(&m, &Policy::default(), 0);
    assert!(matches!(c.verdict, Verdict::Route { ref target, .. } if target.instance == "e1"));
}

#[test]
fn a_remote_answer_books_per_instance_and_names_rank_and_runner_up() {
    let f = Fleet::new(0, false);
    let m = |addr: &str, tokens: u64, dp: &[(&str, u64)]| InstanceMatch {
        address: addr.into(),
        gpu: tokens,
        cpu: tokens,
        disk: tokens,
        longest_matched: tokens,
        dp: dp.iter().map(|(r, t)| (r.to_string(), *t)).collect(),
    };
    let answer = QueryResponse {
        block_size: 16,
        query_blocks: 8,
        instances: [
            ("a".to_string(), m("a:1", 32, &[])),
            ("b".to_string(), m("b:1", 96, &[("0", 16), ("3", 96)])),
        ]
        .into_iter()
        .collect(),
    };
    let picture = Picture::read(&f.store, &f.keys, PC, 0);
    let c = route(
        Field::Answer(&answer),
        Q,
        &picture,
        &Policy::default(),
        &mut SplitMix64(1),
    );
    let Verdict::Route { decision, target } = c.verdict else {
        panic!("routed");
    };
    assert_eq!(target.instance, "b");
    assert_eq!(target.load_id, LoadId::instance("b"));
    assert_eq!(target.slot(), None);
    assert_eq!(target.dp_rank, Some(3), "the rank holding the most tokens");
    assert_eq!(target.runner_up.as_deref(), Some("a:1"));
    assert_eq!(decision.matched_blocks, 6);
}

#[test]
fn no_serving_engine_is_no_match_and_defer_leaves_cold_requests_to_the_gateway() {
    let f = Fleet::new(0, true);
    let (c, _) = f.decide(&[held(0, 8)], &Policy::default(), 0);
    assert_eq!(c.verdict, Verdict::NoMatch, "e0 serves another model");
    let f = Fleet::new(2, false);
    let defer = Policy {
        cold: Cold::Defer,
        ..Policy::default()
    };
    let (c, _) = f.decide(&[], &defer, 0);
    assert_eq!(c.verdict, Verdict::Deferred);
    let (c, _) = f.decide(&[held(1, 2)], &defer, 0);
    assert!(
        matches!(c.verdict, Verdict::Route { .. }),
        "a hit is decided"
    );
}
