//! The load a decision reads, in the decision's units: per worker [`Counts`] (what a gateway
//! books and reports), the fleet's sum seen from one gateway ([`fleet_view`]), an engine's own
//! report ([`EngineLoad`]), their sum per instance ([`InstanceLoad`]), and which gateway
//! replica decides ([`Replica`]). Plain data: the mirror's shared-data tables convert into
//! these, not the reverse.

/// Load counts of one worker: what a gateway books, reports and reads back from the fleet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Requests in flight.
    pub requests: u64,
    /// Uncached prefill tokens not yet prefilled.
    pub prefill_tokens: u64,
    /// Decode tokens still to generate.
    pub decode_tokens: u64,
}

/// One gateway replica among the live ones, as the collector numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replica {
    /// This replica's index, `0..count`.
    pub index: u32,
    /// Live replicas (1: this one alone).
    pub count: u32,
}

impl Default for Replica {
    fn default() -> Self {
        Replica { index: 0, count: 1 }
    }
}

impl Replica {
    /// Replica `index` of `count`; `None` unless `index < count`.
    pub fn new(index: u32, count: u32) -> Option<Replica> {
        (index < count).then_some(Replica { index, count })
    }

    /// Parses `"index/count"` (the feed's replica header).
    pub fn parse(s: &str) -> Option<Replica> {
        let (i, n) = s.trim().split_once('/')?;
        Replica::new(i.parse().ok()?, n.parse().ok()?)
    }

    /// This replica's share of `instances` eligible instances when it carries `own` of the
    /// gateways' requests in flight and the others `others`: a run of instances as wide as
    /// its part of the traffic, so a replica sending 80 % of the requests keeps to 80 % of the
    /// fleet, not to `1/count` of it. The part is smoothed towards an even split (one
    /// request each added), so an idle fleet splits evenly; replica `i`'s run starts at
    /// `i/(count − 1)` of the room the others leave it. Two replicas' runs meet exactly; with
    /// more, each guesses the others carry equal parts, and runs may overlap or leave gaps:
    /// this only breaks near-ties.
    pub fn share(&self, own: u64, others: u64, instances: usize) -> Share {
        if self.count <= 1 {
            return Share {
                from: 0,
                to: 1,
                den: 1,
                instances,
            };
        }
        // In exact fractions (boundaries computed in floats leave gaps between two runs):
        // part = a/b, from = (b − a)·i / (b·(n − 1)).
        let n = u128::from(self.count);
        let (own, total) = (u128::from(own), u128::from(own) + u128::from(others));
        // A part within 30 % of an even one is even: counts of a few dozen requests swing
        // that much at an even split, and each swing would move the runs' boundary while the
        // replicas read each other's counts a sync period apart (they would then prefer the
        // same engines at the boundary).
        let (a, b) = if 10 * (own * n).abs_diff(total) <= 3 * total {
            (1, n)
        } else {
            (own + 1, total + n)
        };
        let from = (b - a) * u128::from(self.index);
        Share {
            from,
            to: from + a * (n - 1),
            den: b * (n - 1),
            instances,
        }
    }
}

/// A replica's share of the eligible instances ([`Replica::share`]): `[from, to) / den`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    from: u128,
    to: u128,
    den: u128,
    instances: usize,
}

impl Share {
    /// Whether the `k`-th eligible instance is in the share. Instance `k` takes the `k`-th of
    /// `instances` equal steps of `[0, 1)`; the share holds those whose midpoint it covers,
    /// and the one under its own midpoint, so a share narrower than a step still has one.
    pub fn owns(&self, k: usize) -> bool {
        let n = self.instances.max(1) as u128;
        // Midpoint (2k + 1) / 2n against the bounds, cross-multiplied.
        let x = (2 * k as u128 + 1) * self.den;
        let covered = 2 * n * self.from <= x && x < 2 * n * self.to;
        // The step under the share's midpoint (from + to) / 2den: k ≤ n·mid < k + 1.
        let m = n * (self.from + self.to);
        let under = 2 * self.den * k as u128 <= m && m < 2 * self.den * (k as u128 + 1);
        covered || under
    }
}

/// The load to decide on, from the fleet's `total`, this gateway's `reported` share of it and
/// its `current` books: `total − reported + current`, never below `current` (a total older
/// than our own report must not hide load we know of). When the collector leaves this
/// gateway's report out of `total` (feed `gateway=`), `reported` is zero: `others + current`.
pub fn fleet_view(total: Counts, reported: Counts, current: Counts) -> Counts {
    let f = |t: u64, r: u64, c: u64| t.saturating_sub(r).saturating_add(c).max(c);
    Counts {
        requests: f(total.requests, reported.requests, current.requests),
        prefill_tokens: f(
            total.prefill_tokens,
            reported.prefill_tokens,
            current.prefill_tokens,
        ),
        decode_tokens: f(
            total.decode_tokens,
            reported.decode_tokens,
            current.decode_tokens,
        ),
    }
}

pub use crate::engine::EngineLoad;

/// The load one instance carries, summed over its dp ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct InstanceLoad {
    /// Requests routed to it and not finished.
    pub requests: u32,
    /// Uncached prompt tokens of those requests: prefill work queued.
    pub prefill_tokens: u64,
    /// Decode work of those requests, in tokens (reported to the fleet; not in the cost).
    pub decode_tokens: u64,
    /// Of `requests`, those other gateways booked, as of their last report (0 alone): how
    /// the gateways split the traffic, read by the replica tie-break.
    pub others_requests: u32,
    /// The engine's own report, when fresh: read by the saturation rule.
    pub engine: Option<EngineLoad>,
}

impl InstanceLoad {
    /// Adds one worker's counts.
    pub fn add_counts(&mut self, c: Counts) {
        self.requests = self
            .requests
            .saturating_add(c.requests.min(u64::from(u32::MAX)) as u32);
        self.prefill_tokens = self.prefill_tokens.saturating_add(c.prefill_tokens);
        self.decode_tokens = self.decode_tokens.saturating_add(c.decode_tokens);
    }

    /// Adds another worker's load (a dp rank of the same instance).
    pub fn merge(&mut self, o: InstanceLoad) {
        self.requests = self.requests.saturating_add(o.requests);
        self.prefill_tokens = self.prefill_tokens.saturating_add(o.prefill_tokens);
        self.decode_tokens = self.decode_tokens.saturating_add(o.decode_tokens);
        self.others_requests = self.others_requests.saturating_add(o.others_requests);
        if let Some(e) = o.engine {
            self.add_engine(e);
        }
    }

    /// Folds in one worker's engine report: the busiest rank speaks for the instance.
    pub fn add_engine(&mut self, e: EngineLoad) {
        self.engine = Some(self.engine.unwrap_or_default().busiest(e));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fleet_view_adds_other_gateways_load_to_ours() {
        let c = |requests, prefill_tokens, decode_tokens| Counts {
            requests,
            prefill_tokens,
            decode_tokens,
        };
        // The fleet counts 10 requests, 3 of them ours as last reported; we now have 5.
        assert_eq!(
            fleet_view(c(10, 1000, 500), c(3, 300, 100), c(5, 400, 50)),
            c(12, 1100, 450)
        );
        // A total older than our report (it misses part of it): never below our own.
        assert_eq!(
            fleet_view(c(1, 0, 0), c(3, 300, 0), c(2, 50, 0)),
            c(2, 50, 0)
        );
        // No fleet: our own.
        assert_eq!(
            fleet_view(Counts::default(), Counts::default(), c(4, 4, 4)),
            c(4, 4, 4)
        );
    }

    #[test]
    fn replica_shares_follow_the_traffic() {
        let owned = |r: Replica, own, others, n| -> Vec<usize> {
            let s = r.share(own, others, n);
            (0..n).filter(|&k| s.owns(k)).collect()
        };
        let (r0, r1) = (Replica::new(0, 2).unwrap(), Replica::new(1, 2).unwrap());
        // Idle: half each.
        assert_eq!(owned(r0, 0, 0, 4), [0, 1]);
        assert_eq!(owned(r1, 0, 0, 4), [2, 3]);
        // 80/20 of 40 requests in flight: 33/42 of the fleet and the rest.
        assert_eq!(owned(r0, 32, 8, 4), [0, 1, 2]);
        assert_eq!(owned(r1, 8, 32, 4), [3]);
        // A replica with almost none of the traffic still has one instance.
        assert_eq!(owned(r1, 0, 1000, 16), [15]);
        // Alone: everything.
        assert_eq!(owned(Replica::default(), 5, 0, 3), [0, 1, 2]);
        // Two replicas' shares cover the fleet, and overlap only where one is narrower
        // than an instance (its midpoint's instance is added).
        for own in 0..30u64 {
            for others in 0..30u64 {
                for n in 1..12usize {
                    let (a, b) = (r0.share(own, others, n), r1.share(others, own, n));
                    for k in 0..n {
                        assert!(a.owns(k) || b.owns(k), "{own} {others} {n} {k}");
                        let narrow = |x: u64, y: u64| {
                            (x as f64 + 1.0) / ((x + y) as f64 + 2.0) < 1.0 / n as f64
                        };
                        if a.owns(k) && b.owns(k) {
                            assert!(
                                narrow(own, others) || narrow(others, own),
                                "{own} {others} {n} {k}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn instance_load_sums_counts_and_keeps_the_busiest_engine() {
        let mut l = InstanceLoad::default();
        l.add_counts(Counts {
            requests: 2,
            prefill_tokens: 10,
            decode_tokens: 7,
        });
        l.merge(InstanceLoad {
            requests: 1,
            prefill_tokens: 4,
            decode_tokens: 3,
            others_requests: 1,
            engine: None,
        });
        l.add_engine(EngineLoad {
            waiting: 3,
            running: 1,
            kv_permille: 200,
        });
        l.add_engine(EngineLoad {
            waiting: 1,
            running: 4,
            kv_permille: 900,
        });
        assert_eq!(
            (
                l.requests,
                l.prefill_tokens,
                l.decode_tokens,
                l.others_requests
            ),
            (3, 14, 10, 1),
            "the backlog counts"
        );
        assert_eq!(
            l.engine,
            Some(EngineLoad {
                waiting: 3,
                running: 4,
                kv_permille: 900
            })
        );
    }
}
