//! What the fleet page remembers between refreshes: a few minutes of fleet samples for its
//! chart, and when each worker's event count last moved (the hub counts events but keeps no
//! clock of them).
//!
//! Pure state, no lock and no I/O: the caller reads the hub under its lock into
//! [`WorkerReading`]s, releases it, and passes the clock in.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvroute::event::WorkerId;
use serde::Serialize;

/// One worker as the sampler reads it from the hub.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerReading {
    pub id: WorkerId,
    /// Tells a worker from a later one in the same slot.
    pub generation: u64,
    pub blocks: u64,
    pub events: u64,
}

/// The fleet at one instant, for the chart.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Sample {
    at: Instant,
    /// (block, worker) holds in the index.
    holds: u64,
    /// Events applied since the previous sample, over every worker.
    events: u64,
    /// Blocks per worker, for the first [`History::chart_workers`] worker ids.
    blocks: Vec<(WorkerId, u64)>,
}

/// A sample as `/v1/fleet/overview` shows it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SampleView {
    /// How long ago it was taken.
    pub age_ms: u64,
    pub holds: u64,
    pub events: u64,
    /// `[worker_id, blocks]` pairs.
    pub blocks: Vec<(u32, u64)>,
}

#[derive(Clone, Copy, Debug)]
struct Seen {
    generation: u64,
    events: u64,
    /// When its event count last grew; `None` when it had events before we first looked.
    changed: Option<Instant>,
}

/// Samples over the last [`History::span`] and the last event of each worker.
#[derive(Debug)]
pub struct History {
    samples: VecDeque<Sample>,
    span: Duration,
    chart_workers: usize,
    seen: HashMap<WorkerId, Seen>,
    /// Events counted by [`History::observe`] since the last sample.
    pending_events: u64,
}

impl History {
    /// Keeps `span` of samples, with per-worker blocks for the `chart_workers` lowest ids
    /// (the bound on what a fleet of thousands costs in memory).
    pub fn new(span: Duration, chart_workers: usize) -> History {
        History {
            samples: VecDeque::new(),
            span,
            chart_workers,
            seen: HashMap::new(),
            pending_events: 0,
        }
    }

    pub fn span(&self) -> Duration {
        self.span
    }

    /// Notes every worker's event count at `now`: a count that grew marks an event now, and
    /// the growth is added to the next sample. Workers not in `workers` are forgotten.
    pub fn observe(&mut self, workers: &[WorkerReading], now: Instant) {
        let mut next = HashMap::with_capacity(workers.len());
        for w in workers {
            let seen = match self.seen.get(&w.id) {
                Some(s) if s.generation == w.generation => {
                    if w.events > s.events {
                        self.pending_events += w.events - s.events;
                        Seen {
                            events: w.events,
                            changed: Some(now),
                            ..*s
                        }
                    } else {
                        // A count never shrinks for one generation; keep the higher one.
                        *s
                    }
                }
                // A new worker: everything it counted so far happened since it registered,
                // which for one first seen with events is before we looked.
                _ => {
                    self.pending_events += w.events;
                    Seen {
                        generation: w.generation,
                        events: w.events,
                        changed: None,
                    }
                }
            };
            next.insert(w.id, seen);
        }
        self.seen = next;
    }

    /// Takes a sample at `now` (after [`History::observe`] of the same readings) and drops
    /// the samples older than the span.
    pub fn record(&mut self, holds: u64, workers: &[WorkerReading], now: Instant) {
        self.observe(workers, now);
        let mut blocks: Vec<(WorkerId, u64)> = workers.iter().map(|w| (w.id, w.blocks)).collect();
        blocks.sort_unstable_by_key(|b| b.0);
        blocks.truncate(self.chart_workers);
        self.samples.push_back(Sample {
            at: now,
            holds,
            events: std::mem::take(&mut self.pending_events),
            blocks,
        });
        while self
            .samples
            .front()
            .is_some_and(|s| now.saturating_duration_since(s.at) > self.span)
        {
            self.samples.pop_front();
        }
    }

    /// How long ago `worker` last applied an event, if it did since we first looked.
    pub fn last_event_age(&self, worker: WorkerId, now: Instant) -> Option<Duration> {
        self.seen
            .get(&worker)
            .and_then(|s| s.changed)
            .map(|t| now.saturating_duration_since(t))
    }

    /// The samples, oldest first, as of `now`.
    pub fn samples(&self, now: Instant) -> Vec<SampleView> {
        self.samples
            .iter()
            .map(|s| SampleView {
                age_ms: now.saturating_duration_since(s.at).as_millis() as u64,
                holds: s.holds,
                events: s.events,
                blocks: s.blocks.iter().map(|&(w, b)| (w.0, b)).collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u32, generation: u64, blocks: u64, events: u64) -> WorkerReading {
        WorkerReading {
            id: WorkerId(id),
            generation,
            blocks,
            events,
        }
    }

    #[test]
    fn last_event_age_starts_when_a_count_grows() {
        let mut h = History::new(Duration::from_secs(60), 8);
        let t0 = Instant::now();
        h.observe(&[w(0, 1, 0, 0), w(1, 1, 3, 5)], t0);
        // Worker 1 had events before we looked: no age to show yet.
        assert_eq!(h.last_event_age(WorkerId(1), t0), None);
        assert_eq!(h.last_event_age(WorkerId(0), t0), None);
        let t1 = t0 + Duration::from_secs(2);
        h.observe(&[w(0, 1, 4, 2), w(1, 1, 3, 5)], t1);
        let t2 = t1 + Duration::from_millis(1500);
        assert_eq!(
            h.last_event_age(WorkerId(0), t2),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(h.last_event_age(WorkerId(1), t2), None);
    }

    #[test]
    fn a_reused_slot_starts_over_and_gone_workers_are_forgotten() {
        let mut h = History::new(Duration::from_secs(60), 8);
        let t0 = Instant::now();
        h.observe(&[w(0, 1, 0, 0)], t0);
        h.observe(&[w(0, 1, 1, 10)], t0 + Duration::from_secs(1));
        assert!(h
            .last_event_age(WorkerId(0), t0 + Duration::from_secs(1))
            .is_some());
        // Another worker in slot 0 with fewer events: not an event of the old one.
        h.observe(&[w(0, 2, 0, 3)], t0 + Duration::from_secs(2));
        assert_eq!(
            h.last_event_age(WorkerId(0), t0 + Duration::from_secs(2)),
            None
        );
        h.observe(&[], t0 + Duration::from_secs(3));
        assert_eq!(h.seen.len(), 0);
    }

    #[test]
    fn samples_count_events_between_them_and_age_out() {
        let mut h = History::new(Duration::from_secs(10), 1);
        let t0 = Instant::now();
        h.record(0, &[w(0, 1, 0, 0), w(1, 1, 0, 0)], t0);
        h.observe(&[w(0, 1, 2, 4), w(1, 1, 0, 0)], t0 + Duration::from_secs(1));
        h.record(
            7,
            &[w(0, 1, 5, 9), w(1, 1, 2, 1)],
            t0 + Duration::from_secs(2),
        );
        let s = h.samples(t0 + Duration::from_secs(2));
        assert_eq!(s.len(), 2);
        assert_eq!(s[1].events, 10, "4 + 5 on worker 0 and 1 on worker 1");
        assert_eq!(s[1].holds, 7);
        assert_eq!(s[1].blocks, vec![(0, 5)], "only the first chart worker");
        assert_eq!(s[0].age_ms, 2000);
        h.record(7, &[], t0 + Duration::from_secs(11));
        let s = h.samples(t0 + Duration::from_secs(11));
        assert_eq!(s.len(), 2, "the first sample is past the 10 s span");
        assert_eq!(s[1].events, 0);
    }
}
