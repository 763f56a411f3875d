//! Which ingest collector reads which engine: each engine's ZMQ stream is opened by exactly
//! one live ingest process, so every batch reaches the event stream once, and the engines are
//! split between ingest processes rather than each reading them all.
//!
//! Why one reader: two ingest processes on the same engine publish every batch twice, and each
//! decides on its own when the engine restarted (`Reset`) or went silent too long (`Expired`).
//! The index replicas read both copies in one order: a late `Reset` from the second reader
//! clears blocks the first had already published after the restart, and every replica ends
//! equally wrong.
//!
//! How: every ingest-role process says it is alive on `<prefix>.ingest.alive` (NATS core) each
//! [`BEAT`]; a member silent for [`MEMBER_TTL`] is gone. An engine belongs to the live member
//! with the highest rendezvous score `xxh3(member, worker key)`, so a member joining or leaving
//! moves only its share. A process listens for [`SETTLE`] before it claims anything, so a
//! restarted one does not take every engine for a moment. When an engine changes hands, the
//! new reader starts from the last batch the stream holds for it (its engine's replay buffer
//! brings what came after), and the old one stops reading; a batch both published in that
//! moment has the same engine sequence number and the index replicas skip the second copy.
//!
//! A member's id is its `--state-dir` (hashed) when it has one, so a process restarted on its
//! state comes back to the engines its snapshot holds; without one, a fresh id per start. A
//! new reader that read the engine before (its last batch known here, from the snapshot)
//! starts from that batch instead, so the engine's replay buffer also fills its own index; the
//! replicas skip what they already have by sequence number.
//!
//! While NATS is down no beat arrives, so who reads what stays as it was until the connection is
//! back and the beats have been heard again for [`SETTLE`].
//!
//! Only `--nats-role ingest` takes part: a `both` process serves from its own index, so it
//! reads every engine itself (one such process is the small-fleet set-up).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// How often an ingest process says it is alive.
pub const BEAT: Duration = Duration::from_millis(250);
/// A member not heard from for this long is gone: its engines move to the others.
pub const MEMBER_TTL: Duration = Duration::from_millis(2000);
/// How long a starting process listens before it claims engines: over two beats, so one late
/// beat does not make it take another's engines; short, since its own engines wait as long
/// (a restarted process's events reach the stream only after it).
pub const SETTLE: Duration = Duration::from_millis(600);
/// Most members remembered (a hostile publisher cannot grow the table past it).
const MAX_MEMBERS: usize = 1024;

/// The live ingest members as one process sees them. Pure: the clock is passed in.
#[derive(Debug)]
pub struct Members {
    me: u64,
    started: Instant,
    seen: HashMap<u64, Instant>,
}

impl Members {
    pub fn new(me: u64, now: Instant) -> Members {
        Members {
            me,
            started: now,
            seen: HashMap::new(),
        }
    }

    /// A beat from `member` at `now`.
    pub fn note(&mut self, member: u64, now: Instant) {
        if member == self.me {
            return;
        }
        if !self.seen.contains_key(&member) && self.seen.len() >= MAX_MEMBERS {
            self.seen
                .retain(|_, at| now.saturating_duration_since(*at) < MEMBER_TTL);
            if self.seen.len() >= MAX_MEMBERS {
                return;
            }
        }
        self.seen.insert(member, now);
    }

    /// Listens again from `now` (after the connection came back: the beats missed while it
    /// was down say nothing about the others).
    pub fn relisten(&mut self, now: Instant) {
        self.started = now;
    }

    /// Whether this process has listened long enough to claim engines.
    pub fn settled(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.started) >= SETTLE
    }

    /// The live members at `now`, this one included, sorted.
    pub fn live(&self, now: Instant) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .seen
            .iter()
            .filter(|(_, at)| now.saturating_duration_since(**at) < MEMBER_TTL)
            .map(|(m, _)| *m)
            .chain(std::iter::once(self.me))
            .collect();
        out.sort_unstable();
        out
    }
}

/// The member of `live` that reads the engine with worker key `key` (highest rendezvous score;
/// ties, which need a hash collision, to the lower id).
pub fn owner(live: &[u64], key: &str) -> Option<u64> {
    live.iter()
        .copied()
        .max_by_key(|m| (xxh3_64_with_seed(key.as_bytes(), *m), std::cmp::Reverse(*m)))
}

/// The member id of a process with `--state-dir dir`.
pub fn member_of_state_dir(dir: &std::path::Path) -> u64 {
    let path = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    xxh3_64_with_seed(path.as_os_str().as_encoded_bytes(), 0x6b76_726f_7574_6531)
}

/// Who reads what, shared by the membership task and [`Shared::start_subscriber`].
#[derive(Debug)]
pub struct Ownership {
    me: std::sync::atomic::AtomicU64,
    /// `None` until settled: nothing is claimed yet.
    live: std::sync::Mutex<Option<Vec<u64>>>,
}

impl Ownership {
    pub fn new(me: u64) -> Ownership {
        Ownership {
            me: std::sync::atomic::AtomicU64::new(me),
            live: std::sync::Mutex::new(None),
        }
    }

    /// This process's member id.
    pub fn me(&self) -> u64 {
        self.me.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets the member id (before the bus tasks start).
    pub fn set_member(&self, me: u64) {
        self.me.store(me, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether this process reads the engine with worker key `key` now.
    pub fn owns(&self, key: &str) -> bool {
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.as_deref()
            .is_some_and(|l| owner(l, key) == Some(self.me()))
    }

    /// The live members, once settled.
    pub fn members(&self) -> Option<Vec<u64>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Takes the live members now; whether they changed.
    pub(crate) fn set(&self, live: Vec<u64>) -> bool {
        let mut cur = self.live.lock().unwrap_or_else(|e| e.into_inner());
        let changed = cur.as_ref() != Some(&live);
        *cur = Some(live);
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_has_one_owner_and_a_leaving_member_moves_only_its_share() {
        let three = [11, 22, 33];
        let keys: Vec<String> = (0..300)
            .map(|i| super::super::worker_key(&format!("e{i}"), 0))
            .collect();
        let before: Vec<u64> = keys.iter().map(|k| owner(&three, k).unwrap()).collect();
        for m in three {
            let share = before.iter().filter(|o| **o == m).count();
            assert!((60..=140).contains(&share), "{m}: {share} of 300");
        }
        let two = [11, 33];
        for (k, b) in keys.iter().zip(&before) {
            let after = owner(&two, k).unwrap();
            if *b == 22 {
                assert_ne!(after, 22);
            } else {
                assert_eq!(after, *b, "{k} moved though its owner stayed");
            }
        }
        // The order members are listed in does not matter.
        assert_eq!(owner(&[33, 11, 22], &keys[0]), owner(&three, &keys[0]));
    }

    #[test]
    fn a_state_dir_names_the_same_member_across_restarts_and_another_dir_another() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let id = member_of_state_dir(a.path());
        assert_eq!(id, member_of_state_dir(a.path()));
        // The same directory named another way is the same member.
        assert_eq!(id, member_of_state_dir(&a.path().join(".")));
        assert_ne!(id, member_of_state_dir(b.path()));
    }

    #[test]
    fn members_expire_and_a_new_process_claims_nothing_before_it_settled() {
        let t0 = Instant::now();
        let mut m = Members::new(1, t0);
        assert!(!m.settled(t0));
        m.note(2, t0);
        m.note(1, t0);
        assert_eq!(m.live(t0), [1, 2]);
        assert!(m.settled(t0 + SETTLE));
        assert_eq!(m.live(t0 + MEMBER_TTL), [1]);
        // Back from a lost connection: listens again before deciding.
        m.relisten(t0 + MEMBER_TTL);
        assert!(!m.settled(t0 + MEMBER_TTL));
        let o = Ownership::new(1);
        assert!(!o.owns("k"), "claims nothing before the first settled tick");
        o.set(vec![1]);
        assert!(o.owns("k"));
    }
}
