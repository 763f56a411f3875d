//! The fleet's load as the lease holder last learned it, in shared data for every VM: per
//! worker slot, the in-flight totals over all gateways (feed op `Load`), this gateway's own
//! last report (already part of those totals), and the engine's own sample.
//!
//! One value under `{prefix}/fleet`, fixed-size entries by slot, rewritten whole by the lease
//! holder on each feed page and each report; request paths only read it.

use crate::codec::{le_u16, le_u64};
use crate::feed::{EngineSample, Op};
use crate::router::load::{Counts, EngineLoad, Replica};

use super::keys::{Keys, LAYOUT_VERSION};
use super::store::{update_value, Store, StoreError};

/// One worker slot's fleet picture.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FleetWorker {
    /// Every live gateway's in-flight load on it, as the collector last summed it.
    pub total: Counts,
    /// This gateway's share of `total`: its last report.
    pub reported: Counts,
    /// The engine's own last sample (stale ones are kept, marked).
    pub engine: Option<EngineSample>,
    /// Consecutive pages whose fresh sample showed the engine idle (nothing running or
    /// waiting), saturating: the leak repair waits for two.
    pub idle_samples: u8,
}

/// The fleet value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fleet {
    /// When the last feed page's totals were stored (ms); sample ages count from here.
    pub received_ms: u64,
    /// This gateway among the live replicas, as the collector last numbered them.
    pub replica: Replica,
    /// By worker slot.
    pub workers: Vec<FleetWorker>,
}

/// Two samples closer than this in time are the same scrape seen on two pages.
const SAMPLE_SLACK_MS: u64 = 50;

const ENTRY: usize = 6 * 8 + 1 + 4 + 4 + 2 + 4 + 1;
const HEADER: usize = 1 + 8 + 2 + 2;
/// The value's first byte: the mirror's layout with bit 6 set since the header holds the
/// replica, so a value of the older layout reads as no fleet picture.
const FORMAT: u8 = LAYOUT_VERSION | 0x40;

impl Fleet {
    /// The worker at `slot` (empty when unknown).
    pub fn worker(&self, slot: u32) -> FleetWorker {
        self.workers.get(slot as usize).copied().unwrap_or_default()
    }

    /// Takes a page's `Load` ops as the current totals and samples: every worker not named
    /// has none. Own reports are kept. Slots at or above `max_workers` are dropped. Returns
    /// false when the page has no `Load` op (a collector without fleet load: nothing changes).
    pub fn apply_ops(&mut self, ops: &[Op], max_workers: u32, now_ms: u64) -> bool {
        let mut seen = false;
        let mut fresh = vec![None; self.workers.len()];
        for op in ops {
            let Op::Load {
                worker,
                requests,
                prefill_tokens,
                decode_tokens,
                engine,
            } = op
            else {
                continue;
            };
            seen = true;
            if worker.0 >= max_workers {
                continue;
            }
            let slot = worker.0 as usize;
            if self.workers.len() <= slot {
                self.workers.resize(slot + 1, FleetWorker::default());
                fresh.resize(slot + 1, None);
            }
            fresh[slot] = Some((
                Counts {
                    requests: *requests,
                    prefill_tokens: *prefill_tokens,
                    decode_tokens: *decode_tokens,
                },
                *engine,
            ));
        }
        if !seen {
            return false;
        }
        let before = self.received_ms;
        for (w, f) in self.workers.iter_mut().zip(fresh) {
            let (total, engine) = f.unwrap_or_default();
            let idle = engine.is_some_and(|e| !e.stale && e.load.idle());
            // Pages come faster than scrapes: only a sample taken after the last one counts.
            let taken = |e: &EngineSample, at: u64| at.saturating_sub(u64::from(e.age_ms));
            let new_sample = match (engine, w.engine) {
                (Some(e), Some(p)) => taken(&e, now_ms) > taken(&p, before) + SAMPLE_SLACK_MS,
                _ => true,
            };
            if !idle {
                w.idle_samples = 0;
            } else if new_sample {
                w.idle_samples = w.idle_samples.saturating_add(1);
            }
            w.total = total;
            w.engine = engine;
        }
        self.received_ms = now_ms;
        true
    }

    /// Records this gateway's report: `reported[slot]` for the slots named, zero elsewhere.
    pub fn set_reported(&mut self, report: &[(u32, Counts)], max_workers: u32) {
        for w in &mut self.workers {
            w.reported = Counts::default();
        }
        for &(slot, c) in report {
            if slot >= max_workers {
                continue;
            }
            if self.workers.len() <= slot as usize {
                self.workers
                    .resize(slot as usize + 1, FleetWorker::default());
            }
            if let Some(w) = self.workers.get_mut(slot as usize) {
                w.reported = c;
            }
        }
    }

    /// The encoded value.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + ENTRY * self.workers.len());
        out.push(FORMAT);
        out.extend_from_slice(&self.received_ms.to_le_bytes());
        let short = |v: u32| v.min(u16::MAX.into()) as u16;
        out.extend_from_slice(&short(self.replica.index).to_le_bytes());
        out.extend_from_slice(&short(self.replica.count).to_le_bytes());
        for w in &self.workers {
            for c in [w.total, w.reported] {
                out.extend_from_slice(&c.requests.to_le_bytes());
                out.extend_from_slice(&c.prefill_tokens.to_le_bytes());
                out.extend_from_slice(&c.decode_tokens.to_le_bytes());
            }
            let e = w.engine.unwrap_or_default();
            out.push(match w.engine {
                None => 0,
                Some(e) if e.stale => 2,
                Some(_) => 1,
            });
            out.extend_from_slice(&e.load.waiting.to_le_bytes());
            out.extend_from_slice(&e.load.running.to_le_bytes());
            out.extend_from_slice(&e.load.kv_permille.to_le_bytes());
            out.extend_from_slice(&e.age_ms.to_le_bytes());
            out.push(w.idle_samples);
        }
        out
    }

    /// Decodes a value; anything malformed reads as no fleet picture.
    pub fn decode(b: &[u8]) -> Fleet {
        if b.first() != Some(&FORMAT) || b.len() < HEADER {
            return Fleet::default();
        }
        let body = b.len() - HEADER;
        if !body.is_multiple_of(ENTRY) {
            return Fleet::default();
        }
        let u32_at = |at: usize| {
            b.get(at..at + 4)
                .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        };
        let workers = (0..body / ENTRY)
            .map(|i| {
                let at = HEADER + i * ENTRY;
                let counts = |at: usize| Counts {
                    requests: le_u64(b, at),
                    prefill_tokens: le_u64(b, at + 8),
                    decode_tokens: le_u64(b, at + 16),
                };
                let e = at + 48;
                let flag = b.get(e).copied().unwrap_or(0);
                let engine = (flag == 1 || flag == 2).then(|| EngineSample {
                    load: EngineLoad {
                        waiting: u32_at(e + 1),
                        running: u32_at(e + 5),
                        kv_permille: le_u16(b, e + 9),
                    },
                    age_ms: u32_at(e + 11),
                    stale: flag == 2,
                });
                FleetWorker {
                    total: counts(at),
                    reported: counts(at + 24),
                    engine,
                    idle_samples: b.get(e + 15).copied().unwrap_or(0),
                }
            })
            .collect();
        Fleet {
            received_ms: le_u64(b, 1),
            replica: Replica::new(le_u16(b, 9).into(), le_u16(b, 11).into()).unwrap_or_default(),
            workers,
        }
    }
}

/// Reads the fleet value (empty when absent or unreadable).
pub fn read_fleet<S: Store>(store: &S, keys: &Keys) -> Fleet {
    store
        .get(keys.fleet())
        .ok()
        .and_then(|(v, _)| v)
        .map(|v| Fleet::decode(&v))
        .unwrap_or_default()
}

/// Read-modify-write of the fleet value with CAS retries; `change` returns whether to write.
///
/// # Errors
/// A host failure, or [`StoreError::CasMismatch`] after [`CAS_RETRIES`](super::CAS_RETRIES) lost races.
pub fn update_fleet<S: Store>(
    store: &S,
    keys: &Keys,
    mut change: impl FnMut(&mut Fleet) -> bool,
) -> Result<(), StoreError> {
    update_value(store, keys.fleet(), None, |v: &mut Vec<u8>| {
        let mut fleet = Fleet::decode(v);
        let write = change(&mut fleet);
        if write {
            *v = fleet.encode();
        }
        write
    })
    .map(|_| ())
}
