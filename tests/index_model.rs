//! The index against a naive reference model, driven by random event sequences.

use std::collections::{BTreeMap, HashMap};

use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier, WorkerId};
use kvroute::hash;
use kvroute::index::{Change, Index, IndexConfig};
use kvroute::lookup::WorkerMatch;
use kvroute::scope::{BlockKey, ScopeId};
use proptest::prelude::*;

const BLOCK: usize = 4;
const TENANTS: [&str; 2] = ["default", "acme"];

/// Tokens are a function of the engine hash, so equal hashes mean equal blocks.
fn tokens_of(h: u64) -> Vec<u32> {
    (0..BLOCK as u32)
        .map(|i| (h as u32).wrapping_mul(31).wrapping_add(i))
        .collect()
}

#[derive(Clone, Debug)]
struct RefNode {
    parent: Option<u64>,
    key: BlockKey,
    scope: ScopeId,
    seed: u64,
    tiers: u8,
}

/// The obvious implementation: per worker, a map of engine hash → node; matching walks.
#[derive(Default)]
struct Model {
    workers: BTreeMap<u32, (String, HashMap<u64, RefNode>)>,
    cap: usize,
}

impl Model {
    fn apply(&mut self, w: u32, event: &KvEvent) {
        let cap = self.cap;
        let Some((tenant, nodes)) = self.workers.get_mut(&w) else {
            return;
        };
        match event {
            KvEvent::BlockStored {
                parent,
                blocks,
                tier,
                lora_name,
                cache_salt,
            } => {
                let (mut parent_hash, mut scope, mut seed) = match parent {
                    Some(p) => match nodes.get(&p.0) {
                        Some(n) => (Some(p.0), n.scope, n.seed),
                        None => return,
                    },
                    None => (
                        None,
                        ScopeId::of(tenant, "m", lora_name.as_deref(), cache_salt.as_deref()),
                        hash::seed(lora_name.as_deref(), cache_salt.as_deref()),
                    ),
                };
                for b in blocks {
                    if let Some(n) = nodes.get_mut(&b.hash.0) {
                        n.tiers |= 1 << *tier as u8;
                        (scope, seed) = (n.scope, n.seed);
                        parent_hash = Some(b.hash.0);
                        continue;
                    }
                    if nodes.len() >= cap {
                        break;
                    }
                    let parent_seq = parent_hash.map(|p| scope.seq(nodes[&p].key));
                    let seq = hash::chain(parent_seq, hash::block_hash(&b.tokens, seed));
                    nodes.insert(
                        b.hash.0,
                        RefNode {
                            parent: parent_hash,
                            key: scope.key(seq),
                            scope,
                            seed,
                            tiers: 1 << *tier as u8,
                        },
                    );
                    parent_hash = Some(b.hash.0);
                }
            }
            KvEvent::BlockRemoved { hashes, tier } => {
                for h in hashes {
                    if !nodes.contains_key(&h.0) {
                        continue;
                    }
                    // The subtree of h loses the tier; holds left with none go with their subtrees.
                    let sub: Vec<u64> = nodes
                        .keys()
                        .copied()
                        .filter(|&n| is_under(nodes, n, h.0))
                        .collect();
                    for n in &sub {
                        nodes.get_mut(n).unwrap().tiers &= !(1 << *tier as u8);
                    }
                    let empty: Vec<u64> = sub
                        .iter()
                        .copied()
                        .filter(|n| nodes[n].tiers == 0)
                        .collect();
                    let doomed: Vec<u64> = nodes
                        .keys()
                        .copied()
                        .filter(|&n| empty.iter().any(|&e| is_under(nodes, n, e)))
                        .collect();
                    for n in doomed {
                        nodes.remove(&n);
                    }
                }
            }
            KvEvent::AllBlocksCleared => nodes.clear(),
        }
    }

    /// Per worker, per class: leading query keys held at that class or better.
    fn lookup(&self, keys: &[BlockKey]) -> Vec<WorkerMatch> {
        let mut out = Vec::new();
        for (&w, (_, nodes)) in &self.workers {
            let mut blocks = [0u32; 3];
            let mut class = 0u8;
            let mut parent: Option<u64> = None;
            for (d, key) in keys.iter().enumerate() {
                let Some((&h, n)) = nodes
                    .iter()
                    .find(|(_, n)| n.key == *key && n.parent == parent)
                else {
                    break;
                };
                class = class.max(n.tiers.trailing_zeros() as u8);
                for c in class..3 {
                    blocks[c as usize] = d as u32 + 1;
                }
                parent = Some(h);
            }
            if blocks[2] > 0 {
                out.push(WorkerMatch {
                    worker: WorkerId(w),
                    blocks,
                });
            }
        }
        out
    }

    /// Key chains of every node, for queries that hit.
    fn chains(&self) -> Vec<Vec<BlockKey>> {
        let mut out = Vec::new();
        for (_, nodes) in self.workers.values() {
            for &h in nodes.keys() {
                let mut chain = Vec::new();
                let mut cur = Some(h);
                while let Some(c) = cur {
                    chain.push(nodes[&c].key);
                    cur = nodes[&c].parent;
                }
                chain.reverse();
                out.push(chain);
            }
        }
        out
    }
}

fn is_under(nodes: &HashMap<u64, RefNode>, mut n: u64, ancestor: u64) -> bool {
    loop {
        if n == ancestor {
            return true;
        }
        match nodes.get(&n).and_then(|x| x.parent) {
            Some(p) => n = p,
            None => return false,
        }
    }
}

#[derive(Clone, Debug)]
enum Step {
    Store {
        w: u32,
        parent: Option<u64>,
        hashes: Vec<u64>,
        tier: u8,
        salt: bool,
    },
    Remove {
        w: u32,
        hashes: Vec<u64>,
        tier: u8,
    },
    Clear {
        w: u32,
    },
    Unregister {
        w: u32,
    },
    Register {
        w: u32,
    },
    Query {
        pick: usize,
        extend: Vec<u64>,
        cut: usize,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let h = 0u64..24;
    prop_oneof![
        6 => (0u32..4, proptest::option::of(h.clone()), proptest::collection::vec(h.clone(), 1..5), 0u8..3, any::<bool>())
            .prop_map(|(w, parent, hashes, tier, salt)| Step::Store { w, parent, hashes, tier, salt }),
        2 => (0u32..4, proptest::collection::vec(h.clone(), 1..3), 0u8..3).prop_map(|(w, hashes, tier)| Step::Remove { w, hashes, tier }),
        1 => (0u32..4).prop_map(|w| Step::Clear { w }),
        1 => (0u32..4).prop_map(|w| Step::Unregister { w }),
        1 => (0u32..4).prop_map(|w| Step::Register { w }),
        4 => (any::<usize>(), proptest::collection::vec(any::<u64>(), 0..2), 0usize..3)
            .prop_map(|(pick, extend, cut)| Step::Query { pick, extend, cut }),
    ]
}

fn sorted(mut v: Vec<WorkerMatch>) -> Vec<WorkerMatch> {
    v.sort_by_key(|m| m.worker);
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn index_agrees_with_reference(steps in proptest::collection::vec(step(), 1..60), cap in 4usize..40) {
        let mut index = Index::new(IndexConfig { max_blocks_per_worker: cap });
        let mut model = Model { cap, ..Model::default() };
        let mut changes: Vec<Change> = Vec::new();
        // The feed's view: the holds the changes describe, replayed.
        let mut fed: HashMap<(u32, u64), Tier> = HashMap::new();
        for w in 0..3u32 {
            index.add_worker(WorkerId(w), TENANTS[w as usize % 2], "m", BLOCK as u32);
            model.workers.insert(w, (TENANTS[w as usize % 2].to_owned(), HashMap::new()));
        }
        for step in steps {
            changes.clear();
            match step {
                Step::Store { w, parent, hashes, tier, salt } => {
                    let event = KvEvent::BlockStored {
                        parent: parent.map(EngineHash),
                        blocks: hashes.iter().map(|&h| StoredBlock { hash: EngineHash(h), tokens: tokens_of(h), block_hash: None }).collect(),
                        tier: Tier::from_u8(tier).unwrap(),
                        lora_name: None,
                        cache_salt: salt.then(|| "s".to_owned()),
                    };
                    index.apply(WorkerId(w), &event, &mut changes);
                    model.apply(w, &event);
                }
                Step::Remove { w, hashes, tier } => {
                    let event = KvEvent::BlockRemoved { hashes: hashes.into_iter().map(EngineHash).collect(), tier: Tier::from_u8(tier).unwrap() };
                    index.apply(WorkerId(w), &event, &mut changes);
                    model.apply(w, &event);
                }
                Step::Clear { w } => {
                    index.apply(WorkerId(w), &KvEvent::AllBlocksCleared, &mut changes);
                    model.apply(w, &KvEvent::AllBlocksCleared);
                }
                Step::Unregister { w } => {
                    index.remove_worker(WorkerId(w), &mut changes);
                    model.workers.remove(&w);
                }
                Step::Register { w } => {
                    index.add_worker(WorkerId(w), TENANTS[w as usize % 2], "m", BLOCK as u32);
                    model.workers.entry(w).or_insert_with(|| (TENANTS[w as usize % 2].to_owned(), HashMap::new()));
                }
                Step::Query { pick, extend, cut } => {
                    let chains = model.chains();
                    let mut keys = if chains.is_empty() { Vec::new() } else { chains[pick % chains.len()].clone() };
                    keys.truncate(keys.len().saturating_sub(cut).max(1.min(keys.len())));
                    keys.extend(extend.into_iter().map(BlockKey));
                    prop_assert_eq!(sorted(index.lookup(&keys)), model.lookup(&keys), "keys {:?}", keys);
                }
            }
            for c in &changes {
                if c.added {
                    prop_assert!(fed.insert((c.worker.0, c.key.0), c.tier).is_none(), "double add {:?}", c);
                } else {
                    prop_assert_eq!(fed.remove(&(c.worker.0, c.key.0)), Some(c.tier), "remove of unknown {:?}", c);
                }
            }
            let holds: usize = model.workers.values().map(|(_, n)| n.len()).sum();
            prop_assert_eq!(index.stats().holds, holds);
            prop_assert_eq!(fed.len(), holds);
        }
        // Export and import keep every answer.
        let copy = Index::import(index.config(), &index.export());
        for chain in model.chains() {
            prop_assert_eq!(sorted(copy.lookup(&chain)), sorted(index.lookup(&chain)));
        }
        prop_assert_eq!(copy.stats(), index.stats());
    }
}

#[test]
fn tenants_with_the_same_tokens_stay_apart() {
    let mut index = Index::new(IndexConfig::default());
    index.add_worker(WorkerId(0), "a", "m", 4);
    index.add_worker(WorkerId(1), "b", "m", 4);
    let event = KvEvent::BlockStored {
        parent: None,
        blocks: vec![StoredBlock {
            hash: EngineHash(1),
            tokens: vec![1, 2, 3, 4],
            block_hash: None,
        }],
        tier: Tier::Gpu,
        lora_name: None,
        cache_salt: None,
    };
    let mut changes = Vec::new();
    index.apply(WorkerId(0), &event, &mut changes);
    let seqs = hash::sequence_hashes(&[1, 2, 3, 4], 4, hash::BASE_SEED).unwrap();
    let key_a = ScopeId::of("a", "m", None, None).key(seqs[0]);
    let key_b = ScopeId::of("b", "m", None, None).key(seqs[0]);
    assert_eq!(index.lookup(&[key_a]).len(), 1);
    assert!(index.lookup(&[key_b]).is_empty());
}

#[test]
fn orphans_and_bad_blocks_are_counted_not_guessed() {
    let mut index = Index::new(IndexConfig::default());
    index.add_worker(WorkerId(0), "a", "m", 4);
    let mut changes = Vec::new();
    let orphan = KvEvent::BlockStored {
        parent: Some(EngineHash(99)),
        blocks: vec![StoredBlock {
            hash: EngineHash(1),
            tokens: vec![1, 2, 3, 4],
            block_hash: None,
        }],
        tier: Tier::Gpu,
        lora_name: None,
        cache_salt: None,
    };
    assert_eq!(index.apply(WorkerId(0), &orphan, &mut changes).orphans, 1);
    let short = KvEvent::BlockStored {
        parent: None,
        blocks: vec![StoredBlock {
            hash: EngineHash(1),
            tokens: vec![1, 2, 3],
            block_hash: None,
        }],
        tier: Tier::Gpu,
        lora_name: None,
        cache_salt: None,
    };
    assert_eq!(index.apply(WorkerId(0), &short, &mut changes).bad_blocks, 1);
    assert_eq!(
        index
            .apply(WorkerId(7), &KvEvent::AllBlocksCleared, &mut changes)
            .unknown_worker,
        1
    );
    assert!(changes.is_empty());
    assert_eq!(index.stats().holds, 0);
}
