//! The mirror's live workers grouped by instance, and the contenders of a local decision:
//! matches per worker slot folded into each instance's best rank, with its load.

use super::decide::Contender;
use super::load::InstanceLoad;
use crate::lookup::WorkerMatch;
use crate::mirror::{LoadId, Meta};
use crate::select::Weights;

/// One worker slot of an instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The mirror's worker slot.
    pub slot: u32,
    /// The dp rank of that worker.
    pub dp_rank: u32,
}

/// An instance (one `instance_id`) of the mirror and its live worker slots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Instance {
    /// The engine's instance id.
    pub id: String,
    /// Where to send its requests (`host:port`).
    pub address: String,
    /// Its live workers, in slot order.
    pub slots: Vec<Slot>,
    /// `(tenant, model)` its workers are registered for.
    pub models: Vec<(String, String)>,
}

impl Instance {
    /// Whether a request of `(tenant, model)` may go here: an engine serves the models it was
    /// registered with (a worker registered without one is a candidate for any).
    pub fn serves(&self, tenant: &str, model: &str) -> bool {
        self.models
            .iter()
            .any(|(t, m)| m.is_empty() || (t == tenant && m == model))
    }

    /// Whether it has more than one dp rank (the rank header is then set).
    pub fn is_multi_rank(&self) -> bool {
        self.slots.len() > 1
    }

    /// The slot of `dp_rank`, or the first slot when no worker has that rank.
    pub fn slot_of_rank(&self, dp_rank: u32) -> Option<u32> {
        self.slots
            .iter()
            .find(|s| s.dp_rank == dp_rank)
            .or(self.slots.first())
            .map(|s| s.slot)
    }
}

/// The mirror's live workers grouped by instance: built once per meta change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roster {
    /// Every instance with a live worker, in order of first slot.
    pub instances: Vec<Instance>,
    /// Slot → (index into `instances`, dp rank).
    slot_instance: Vec<Option<(u32, u32)>>,
}

impl Roster {
    /// Groups the live workers of `meta` by instance id.
    pub fn from_meta(meta: &Meta) -> Roster {
        let mut r = Roster {
            instances: Vec::new(),
            slot_instance: vec![None; meta.workers.len()],
        };
        for (slot, w) in meta.workers.iter().enumerate() {
            let Some(w) = w.as_ref().filter(|w| w.live) else {
                continue;
            };
            let idx = match r.instances.iter().position(|i| i.id == w.instance_id) {
                Some(i) => i,
                None => {
                    r.instances.push(Instance {
                        id: w.instance_id.clone(),
                        address: w.address.clone(),
                        ..Instance::default()
                    });
                    r.instances.len() - 1
                }
            };
            if let Some(inst) = r.instances.get_mut(idx) {
                inst.slots.push(Slot {
                    slot: slot as u32,
                    dp_rank: w.dp_rank,
                });
                if !inst
                    .models
                    .iter()
                    .any(|(t, m)| *t == w.tenant && *m == w.model)
                {
                    inst.models.push((w.tenant.clone(), w.model.clone()));
                }
            }
            if let Some(s) = r.slot_instance.get_mut(slot) {
                *s = Some((idx as u32, w.dp_rank));
            }
        }
        r
    }

    /// The instance index and dp rank of worker slot `slot`.
    pub fn instance_of(&self, slot: u32) -> Option<(usize, u32)> {
        self.slot_instance
            .get(slot as usize)
            .copied()
            .flatten()
            .map(|(i, r)| (i as usize, r))
    }

    /// Local mode's contenders, one per instance: `matches` (per worker slot, from the
    /// walk) folded into each instance's best rank, the load of its slots summed from
    /// `load` (per worker slot), eligibility from `(tenant, model)`.
    pub fn contenders(
        &self,
        matches: &[WorkerMatch],
        tenant: &str,
        model: &str,
        load: impl Fn(LoadId) -> InstanceLoad,
        weights: &Weights,
    ) -> Vec<Contender> {
        let mut out: Vec<Contender> = self
            .instances
            .iter()
            .map(|inst| {
                let mut l = InstanceLoad::default();
                for s in &inst.slots {
                    l.merge(load(LoadId::slot(s.slot)));
                }
                Contender::new(inst.serves(tenant, model), l)
            })
            .collect();
        for m in matches {
            if let Some((i, rank)) = self.instance_of(m.worker.0) {
                if let Some(c) = out.get_mut(i) {
                    c.offer(rank, m.blocks, weights);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::WorkerId;
    use crate::mirror::{Load, WorkerSlot};
    use crate::router::{decide, Policy, Query};
    use crate::select::SplitMix64;

    const Q: Query = Query {
        blocks: 16,
        block_size: 16,
    };

    fn slot(inst: &str, dp_rank: u32, model: &str) -> Option<WorkerSlot> {
        Some(WorkerSlot {
            live: true,
            dp_rank,
            instance_id: inst.into(),
            address: format!("{inst}:8000"),
            tenant: "default".into(),
            model: model.into(),
        })
    }

    #[test]
    fn the_roster_groups_ranks_and_sums_their_load() {
        let meta = Meta {
            workers: vec![
                slot("a", 0, "m"),
                slot("b", 0, "other"),
                slot("a", 1, "m"),
                None,
                slot("c", 0, ""),
            ],
            ..Meta::default()
        };
        let roster = Roster::from_meta(&meta);
        assert_eq!(roster.instances.len(), 3);
        assert_eq!(roster.instance_of(2), Some((0, 1)));
        assert_eq!(roster.instance_of(3), None);
        assert_eq!(roster.instances[0].slot_of_rank(1), Some(2));
        assert_eq!(roster.instances[0].slot_of_rank(7), Some(0));
        assert!(roster.instances[0].is_multi_rank());
        let matches = [
            WorkerMatch {
                worker: WorkerId(0),
                blocks: [2, 2, 2],
            },
            WorkerMatch {
                worker: WorkerId(2),
                blocks: [5, 5, 5],
            },
        ];
        let load = |id: LoadId| {
            InstanceLoad::from(Load::booked(
                u32::from(id == LoadId::slot(0) || id == LoadId::slot(2)),
                16,
                0,
            ))
        };
        let cs = roster.contenders(&matches, "default", "m", load, &Weights::default());
        assert_eq!((cs[0].dp_rank, cs[0].matched), (1, [5, 5, 5]));
        assert_eq!((cs[0].load.requests, cs[0].load.prefill_tokens), (2, 32));
        assert_eq!(
            cs.iter().map(|c| c.eligible).collect::<Vec<_>>(),
            [true, false, true],
            "b serves another model; c registered without one serves any"
        );
        // a: 11 uncached + 2 queued + 2 requests = 15 < c: 16 + 1 + 0 = 17.
        let d = decide(&cs, Q, &Policy::default(), &mut SplitMix64(1)).unwrap();
        assert_eq!((d.best, d.runner_up, d.dp_rank), (0, Some(2), 1));
    }
}
