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

    /// Whether the `k`-th eligible instance is in this replica's share.
    pub fn owns(&self, k: usize) -> bool {
        self.count <= 1 || k % self.count as usize == self.index as usize
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
            (l.requests, l.prefill_tokens, l.decode_tokens),
            (3, 14, 10),
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
