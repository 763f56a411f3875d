//! The bounded in-memory log behind `GET /v1/feed` (protocol: `kvroute::feed`).
//!
//! Every change the filter must see is appended as one [`Entry`]: block holds gained and lost
//! (the index's [`Change`]s, removals already expanded by its cascade), worker table changes,
//! block sizes and aliases. An entry's cursor is its position since the collector started.
//!
//! - A reader with this epoch and a cursor still in the log gets the entries after it, grouped
//!   into ops, up to `max_page_bytes` per page, with `MORE` when the log goes further.
//! - Any other reader gets a full snapshot taken at some log position `head`, cut into pages:
//!   the first flagged `RESET`, the middle ones carrying snapshot cursors (high bit set) and
//!   `MORE`, the last carrying `head` itself, so the reader goes on with deltas. The latest
//!   snapshot is kept and served again to new readers while `head` is still in the log, so a
//!   fleet of filters resyncing at once costs one snapshot.
//!
//! Bound: at most `max_entries` entries; the oldest are dropped first (readers behind them get a
//! snapshot). Snapshot pages are bounded by `max_page_bytes` like delta pages.
//!
//! A collector that builds its index from a NATS stream also marks, after each stream message
//! it applied, the log position its changes end at ([`FeedLog::mark`]). Pages then tell
//! readers their position in stream terms ([`FeedLog::mark_at`]), and a reader that followed
//! another replica of the same stream is taken over from the position after its last
//! sequence ([`FeedLog::handover`]; protocol in `kvroute::feed`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute::event::{Tier, WorkerId};
use kvroute::feed::{Op, Page, StreamMark};
use kvroute::index::Change;
use kvroute::scope::BlockKey;

/// Marks a cursor that points into a snapshot rather than the log.
const SNAPSHOT_BIT: u64 = 1 << 63;

/// One logged change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    Change(Change),
    /// Worker, WorkerGone, BlockSize or Alias (boxed: rare and large).
    Op(Box<Op>),
}

/// A full snapshot, encoded once.
#[derive(Debug)]
pub struct Snapshot {
    id: u32,
    /// Log position the snapshot reflects.
    pub head: u64,
    pages: Vec<Bytes>,
}

/// What a feed request gets.
#[derive(Debug)]
pub enum Reply {
    /// Ready bytes.
    Page(Bytes),
    /// The caller must build a snapshot (with [`FeedLog::build_snapshot`]) and ask again.
    NeedSnapshot,
}

#[derive(Debug)]
pub struct FeedLog {
    epoch: u64,
    /// Cursor of `entries[0]`.
    base: u64,
    entries: VecDeque<Entry>,
    max_entries: usize,
    max_page_bytes: usize,
    snapshot: Mutex<Option<Arc<Snapshot>>>,
    next_snapshot: u32,
    /// The stream the index is built from (0: none).
    stream: u64,
    /// Stream messages applied, as runs that end at the same log position, oldest first.
    marks: VecDeque<Mark>,
    /// The last stream message taken (applied or skipped as a copy), or where the consumer
    /// began: a reader ahead of it waits, one at or behind it with no mark gets a snapshot.
    taken: u64,
    /// The log's head when `taken` was, while nothing is marked yet.
    taken_pos: u64,
    /// When the consumer last made progress (opened, took a message), or, before it has
    /// opened, when this index replica began expecting it.
    active_at: Option<Instant>,
}

/// Stream messages `first..=last` applied, their changes all before log position `pos` (and
/// any messages between the two runs either side changed nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mark {
    first: u64,
    last: u64,
    pos: u64,
}

/// How [`FeedLog::handover`] answers a reader of another replica of the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handover {
    /// This log continues the reader's position from this cursor.
    From(u64),
    /// This replica has not yet applied the reader's position (it will soon): nothing new.
    Wait,
}

/// How far behind a reader's position a replica may be and still ask it to wait, in stream
/// messages (further behind: a snapshot, as for any stranger)...
const MAX_WAIT_MESSAGES: u64 = 10_000;
/// ...and for how long since it last applied a message: a replica that has stopped applying
/// (NATS away, its consumer broken) must not keep a reader waiting on an index that does not
/// move while telling it that it is in sync.
const MAX_WAIT_IDLE: Duration = Duration::from_secs(5);

impl FeedLog {
    /// `epoch` must differ from every earlier run's (the caller uses the start time).
    pub fn new(epoch: u64, max_entries: usize, max_page_bytes: usize) -> FeedLog {
        FeedLog {
            epoch,
            base: 0,
            entries: VecDeque::new(),
            max_entries: max_entries.max(1),
            max_page_bytes: max_page_bytes.max(256),
            snapshot: Mutex::new(None),
            next_snapshot: 1,
            stream: 0,
            marks: VecDeque::new(),
            taken: 0,
            taken_pos: 0,
            active_at: None,
        }
    }

    /// This collector builds its index from a stream whose consumer has not opened yet (a
    /// replica starting): a reader of another replica waits a little rather than taking a
    /// snapshot from an index that is about to catch up.
    pub fn expect_stream(&mut self, now: Instant) {
        if self.stream == 0 {
            self.active_at = Some(now);
        }
    }

    /// The stream the index is built from from now on (its identity, never 0), its consumer
    /// opened at `now` to deliver the messages after `start` (`None`: where it left off).
    /// Another stream forgets the marks of the last.
    pub fn set_stream(&mut self, stream: u64, start: Option<u64>, now: Instant) {
        if stream != self.stream {
            self.stream = stream;
            self.marks.clear();
            self.taken = 0;
        }
        if let Some(start) = start.filter(|&s| s > self.taken) {
            self.taken = start;
            self.taken_pos = self.head();
        }
        self.active_at = Some(now);
    }

    /// Stream message `seq` has been taken at `now`: its changes (if `applied`; otherwise it
    /// was bad input or a second copy) are all in the log.
    ///
    /// Marks begin with the first message applied. A replica restored from its state file
    /// is sent again what its durable consumer had not acknowledged, and skips it as copies
    /// its state already holds, though its log does not: a reader behind the last copy lacks
    /// changes this log never had. The first message applied shows where the state file
    /// ended (the message taken before it), and a reader exactly there goes on from the
    /// position the log had then.
    pub fn mark(&mut self, seq: u64, applied: bool, now: Instant) {
        if self.stream == 0 {
            return;
        }
        self.active_at = Some(now);
        if self.marks.is_empty() {
            if !applied {
                self.taken = self.taken.max(seq);
                self.taken_pos = self.head();
                return;
            }
            if 0 < self.taken && self.taken < seq {
                self.marks.push_back(Mark {
                    first: self.taken,
                    last: self.taken,
                    pos: self.taken_pos,
                });
            }
        }
        self.taken = self.taken.max(seq);
        let pos = self.head();
        match self.marks.back_mut() {
            // A message delivered again (its acknowledgement was late): already marked.
            Some(m) if seq <= m.last => return,
            Some(m) if m.pos == pos => {
                m.last = seq;
                return;
            }
            _ => {}
        }
        self.marks.push_back(Mark {
            first: seq,
            last: seq,
            pos,
        });
        // Keep one mark before the log's start: pages at its first positions still need it.
        while self.marks.len() > 1 && self.marks[1].pos <= self.base {
            self.marks.pop_front();
        }
    }

    /// The stream position log cursor `cursor` completes: the last message whose changes all
    /// lie before it. `None` off a stream, inside snapshots, or before the first mark.
    pub fn mark_at(&self, cursor: u64) -> Option<StreamMark> {
        if self.stream == 0 || cursor & SNAPSHOT_BIT != 0 {
            return None;
        }
        let i = self.marks.partition_point(|m| m.pos <= cursor);
        let m = self.marks.get(i.checked_sub(1)?)?;
        Some(StreamMark {
            stream: self.stream,
            seq: m.last,
        })
    }

    /// Where this log takes over a reader of another replica of the same stream that has
    /// applied every message up to `at.seq`; `None`: it cannot (another stream, a position
    /// this log no longer holds or never saw, or one too far ahead), a snapshot it is.
    pub fn handover(&self, at: StreamMark, now: Instant) -> Option<Handover> {
        let active = self
            .active_at
            .is_some_and(|t| now.saturating_duration_since(t) <= MAX_WAIT_IDLE);
        if self.stream == 0 {
            // Starting: which stream is not known yet, so the wait is bounded by time alone.
            return active.then_some(Handover::Wait);
        }
        if at.stream != self.stream {
            return None;
        }
        match self.marks.back() {
            Some(last) if at.seq <= last.last => {
                // The last run that began at or before `at.seq`: after it, nothing changed the
                // log until the next run began.
                let i = self.marks.partition_point(|m| m.first <= at.seq);
                let m = self.marks.get(i.checked_sub(1)?)?;
                (m.pos >= self.base).then_some(Handover::From(m.pos))
            }
            // Behind what this replica has taken and no mark: the changes the reader lacks
            // are in this index but not in its log (copies its state file held).
            _ if at.seq < self.taken => None,
            // Exactly there with no mark yet: the next message applied tells whether the
            // state file ended there too (see `mark`).
            _ => (active && at.seq - self.taken <= MAX_WAIT_MESSAGES).then_some(Handover::Wait),
        }
    }

    /// The stream this log's index is built from (0: none).
    pub fn stream(&self) -> u64 {
        self.stream
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Cursor after the last entry.
    pub fn head(&self) -> u64 {
        self.base + self.entries.len() as u64
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn push_change(&mut self, change: Change) {
        self.push(Entry::Change(change));
    }

    pub fn push_op(&mut self, op: Op) {
        self.push(Entry::Op(Box::new(op)));
    }

    fn push(&mut self, entry: Entry) {
        if self.entries.len() >= self.max_entries {
            self.entries.pop_front();
            self.base += 1;
            // A snapshot whose head has left the log can hand no reader over to it: every
            // reader would be sent to a new one, so its pages (megabytes for a large index)
            // need not be held until the next snapshot, which may never come.
            let snapshot = self.snapshot.get_mut().unwrap_or_else(|e| e.into_inner());
            if snapshot.as_ref().is_some_and(|s| s.head < self.base) {
                *snapshot = None;
            }
        }
        self.entries.push_back(entry);
    }

    /// Answers `GET /v1/feed?epoch=&since=`.
    pub fn reply(&self, epoch: Option<u64>, since: Option<u64>) -> Reply {
        let same_epoch = epoch == Some(self.epoch);
        match since {
            Some(c) if same_epoch && c & SNAPSHOT_BIT != 0 => {
                let id = ((c >> 32) & 0x7fff_ffff) as u32;
                let page = (c & 0xffff_ffff) as usize;
                let snap = self
                    .snapshot
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                match snap {
                    Some(s) if s.id == id && page < s.pages.len() => {
                        Reply::Page(self.serve_snapshot_page(&s, page))
                    }
                    _ => self.snapshot_reply(),
                }
            }
            Some(c) if same_epoch && c >= self.base && c <= self.head() => {
                Reply::Page(self.deltas(c))
            }
            _ => self.snapshot_reply(),
        }
    }

    fn snapshot_reply(&self) -> Reply {
        let snap = self
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match snap {
            // Still continuable: the reader will pick up the log at `head`.
            Some(s) if s.head >= self.base && s.head <= self.head() => {
                Reply::Page(self.serve_snapshot_page(&s, 0))
            }
            _ => Reply::NeedSnapshot,
        }
    }

    fn serve_snapshot_page(&self, snap: &Snapshot, page: usize) -> Bytes {
        let bytes = snap.pages[page].clone();
        if page + 1 == snap.pages.len() && self.head() > snap.head {
            // More deltas are already waiting after the snapshot: say so.
            let mut v = bytes.to_vec();
            v[5] |= Page::MORE;
            return Bytes::from(v);
        }
        bytes
    }

    /// Encodes the entries after `since` into one page.
    fn deltas(&self, since: u64) -> Bytes {
        let mut ops: Vec<Op> = Vec::new();
        let mut bytes = 32;
        let mut cursor = since;
        let start = (since - self.base) as usize;
        for entry in self.entries.range(start..) {
            let cost = match entry {
                Entry::Change(_) => 8,
                Entry::Op(op) => op.encoded_len(),
            };
            // Always make progress, even past the limit, with one op.
            if bytes + cost + 24 > self.max_page_bytes && cursor > since {
                break;
            }
            match entry {
                Entry::Change(c) => {
                    let merged = match ops.last_mut() {
                        Some(Op::Blocks {
                            worker,
                            tier,
                            added,
                            keys,
                        }) if *worker == c.worker && *tier == c.tier && *added == c.added => {
                            keys.push(c.key);
                            true
                        }
                        _ => false,
                    };
                    if merged {
                        bytes += 8;
                    } else {
                        ops.push(Op::Blocks {
                            worker: c.worker,
                            tier: c.tier,
                            added: c.added,
                            keys: vec![c.key],
                        });
                        bytes += 24 + 8;
                    }
                }
                Entry::Op(op) => {
                    ops.push((**op).clone());
                    bytes += cost;
                }
            }
            cursor += 1;
        }
        let flags = if cursor < self.head() { Page::MORE } else { 0 };
        Bytes::from(
            Page {
                flags,
                epoch: self.epoch,
                cursor,
                ops,
            }
            .to_bytes(),
        )
    }

    /// Builds and keeps a snapshot at the current head from the full state: `table` (workers,
    /// block sizes, aliases) and every hold.
    pub fn build_snapshot(
        &mut self,
        table: Vec<Op>,
        holds: impl FnOnce(&mut dyn FnMut(WorkerId, Tier, BlockKey)),
    ) {
        let mut groups: hashbrown::HashMap<(WorkerId, Tier), Vec<BlockKey>> =
            hashbrown::HashMap::new();
        holds(&mut |w, t, k| groups.entry((w, t)).or_default().push(k));
        let mut groups: Vec<_> = groups.into_iter().collect();
        groups.sort_unstable_by_key(|((w, t), _)| (*w, *t));
        let id = self.next_snapshot;
        self.next_snapshot = self.next_snapshot.wrapping_add(1) & 0x7fff_ffff;
        let head = self.head();
        let budget = self.max_page_bytes.saturating_sub(64).max(128);
        let mut pages: Vec<Vec<Op>> = vec![Vec::new()];
        let mut used = 0usize;
        let mut push = |op: Op, pages: &mut Vec<Vec<Op>>| {
            let len = op.encoded_len();
            if used + len > budget && !pages.last().is_none_or(|p| p.is_empty()) {
                pages.push(Vec::new());
                used = 0;
            }
            used += len;
            if let Some(p) = pages.last_mut() {
                p.push(op);
            }
        };
        for op in table {
            push(op, &mut pages);
        }
        // Keys per Blocks op such that one op always fits a page.
        let per_op = ((budget - 40) / 8).max(1);
        for ((worker, tier), keys) in groups {
            for chunk in keys.chunks(per_op) {
                push(
                    Op::Blocks {
                        worker,
                        tier,
                        added: true,
                        keys: chunk.to_vec(),
                    },
                    &mut pages,
                );
            }
        }
        let n = pages.len();
        let encoded = pages
            .into_iter()
            .enumerate()
            .map(|(i, ops)| {
                let mut flags = 0;
                if i == 0 {
                    flags |= Page::RESET;
                }
                let cursor = if i + 1 < n {
                    flags |= Page::MORE;
                    SNAPSHOT_BIT | (id as u64) << 32 | (i as u64 + 1)
                } else {
                    head
                };
                Bytes::from(
                    Page {
                        flags,
                        epoch: self.epoch,
                        cursor,
                        ops,
                    }
                    .to_bytes(),
                )
            })
            .collect();
        *self.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(Snapshot {
            id,
            head,
            pages: encoded,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(w: u32, key: u64, added: bool) -> Change {
        Change {
            worker: WorkerId(w),
            tier: Tier::Gpu,
            added,
            key: BlockKey(key),
        }
    }

    fn page(r: Reply) -> Page {
        match r {
            Reply::Page(b) => Page::decode(&b).unwrap(),
            Reply::NeedSnapshot => panic!("snapshot needed"),
        }
    }

    fn snapshot_of(log: &mut FeedLog, keys: &[u64]) {
        let keys = keys.to_vec();
        log.build_snapshot(vec![], move |f| {
            for k in keys {
                f(WorkerId(0), Tier::Gpu, BlockKey(k))
            }
        });
    }

    #[test]
    fn deltas_after_a_cursor_group_into_block_ops() {
        let mut log = FeedLog::new(7, 100, 1 << 20);
        log.push_change(change(0, 1, true));
        log.push_change(change(0, 2, true));
        log.push_change(change(1, 3, true));
        let p = page(log.reply(Some(7), Some(1)));
        assert_eq!(p.cursor, 3);
        assert!(!p.is_reset() && !p.has_more());
        assert_eq!(p.ops.len(), 2);
        assert_eq!(
            p.ops[0],
            Op::Blocks {
                worker: WorkerId(0),
                tier: Tier::Gpu,
                added: true,
                keys: vec![BlockKey(2)]
            }
        );
    }

    #[test]
    fn a_snapshot_is_released_once_its_head_leaves_the_log() {
        let mut log = FeedLog::new(7, 3, 300);
        log.push_change(change(0, 1, true));
        snapshot_of(&mut log, &(0..100).collect::<Vec<u64>>());
        let held = |log: &FeedLog| log.snapshot.lock().unwrap().is_some();
        // Head 1 stays in the log while the log holds it (base 0, then 1)...
        log.push_change(change(0, 2, true));
        log.push_change(change(0, 3, true));
        log.push_change(change(0, 4, true));
        assert!(held(&log), "head 1 == base 1: still continuable");
        assert!(matches!(log.reply(None, None), Reply::Page(_)));
        // ...and goes with it.
        log.push_change(change(0, 5, true));
        assert!(!held(&log), "head 1 < base 2: released");
        assert!(matches!(log.reply(None, None), Reply::NeedSnapshot));
    }

    #[test]
    fn old_cursor_or_other_epoch_gets_a_paged_snapshot() {
        let mut log = FeedLog::new(7, 2, 300);
        for k in 0..5 {
            log.push_change(change(0, k, true));
        }
        assert!(
            matches!(log.reply(Some(7), Some(0)), Reply::NeedSnapshot),
            "cursor 0 fell out of the log"
        );
        assert!(
            matches!(log.reply(Some(8), Some(4)), Reply::NeedSnapshot),
            "another epoch"
        );
        assert!(matches!(log.reply(None, None), Reply::NeedSnapshot));
        let keys: Vec<u64> = (0..100).collect();
        snapshot_of(&mut log, &keys);
        let mut p = page(log.reply(None, None));
        assert!(p.is_reset());
        let mut got = Vec::new();
        let mut pages = 1;
        loop {
            for op in &p.ops {
                if let Op::Blocks { keys, .. } = op {
                    got.extend(keys.iter().map(|k| k.0));
                }
            }
            if !p.has_more() {
                break;
            }
            p = page(log.reply(Some(7), Some(p.cursor)));
            assert!(!p.is_reset());
            pages += 1;
        }
        assert!(pages > 2, "300-byte pages must split 100 keys");
        assert_eq!(got, keys);
        assert_eq!(p.cursor, 5, "the last snapshot page hands over to the log");
        // A change after the snapshot reaches the reader as a delta.
        log.push_change(change(0, 99, false));
        let d = page(log.reply(Some(7), Some(5)));
        assert_eq!(d.cursor, 6);
    }

    #[test]
    fn delta_pages_are_bounded() {
        let mut log = FeedLog::new(1, 10_000, 1024);
        for k in 0..1000 {
            log.push_change(change(0, k, true));
        }
        let mut cursor = 0;
        let mut n = 0;
        loop {
            let Reply::Page(b) = log.reply(Some(1), Some(cursor)) else {
                panic!()
            };
            assert!(b.len() <= 1024, "page of {} bytes", b.len());
            let p = Page::decode(&b).unwrap();
            n += p
                .ops
                .iter()
                .map(|op| {
                    if let Op::Blocks { keys, .. } = op {
                        keys.len()
                    } else {
                        0
                    }
                })
                .sum::<usize>();
            cursor = p.cursor;
            if !p.has_more() {
                break;
            }
        }
        assert_eq!(n, 1000);
    }

    fn at(seq: u64) -> StreamMark {
        StreamMark { stream: 5, seq }
    }

    #[test]
    fn marks_name_log_positions_in_stream_terms() {
        let t = Instant::now();
        let mut log = FeedLog::new(1, 100, 1 << 20);
        log.mark(1, true, t);
        assert_eq!(log.mark_at(0), None, "off a stream, nothing is marked");
        log.set_stream(5, Some(0), t);
        // Message 10 logs two changes, 11 none, 12 one; a local change comes between.
        log.push_change(change(0, 1, true));
        log.push_change(change(0, 2, true));
        log.mark(10, true, t);
        log.mark(11, true, t);
        log.push_op(Op::WorkerGone { id: WorkerId(3) });
        log.push_change(change(0, 3, true));
        log.mark(12, true, t);
        log.mark(11, true, t); // delivered again: already marked
        assert_eq!(log.mark_at(1), None, "inside message 10");
        assert_eq!(log.mark_at(2), Some(at(11)), "10 and 11 end at 2");
        assert_eq!(log.mark_at(3), Some(at(11)));
        assert_eq!(log.mark_at(4), Some(at(12)));
        assert_eq!(log.mark_at(SNAPSHOT_BIT | 4), None);
        // Another replica's reader that has applied through 10 or 11 goes on from 2 (what
        // came after, the local change included, is sent again); through 12, from 4.
        assert_eq!(log.handover(at(10), t), Some(Handover::From(2)));
        assert_eq!(log.handover(at(11), t), Some(Handover::From(2)));
        assert_eq!(log.handover(at(12), t), Some(Handover::From(4)));
        // Before the first mark, another stream: no handover. Ahead: wait, while applying.
        assert_eq!(log.handover(at(9), t), None);
        assert_eq!(log.handover(StreamMark { stream: 6, seq: 12 }, t), None);
        assert_eq!(log.handover(at(13), t), Some(Handover::Wait));
        assert_eq!(log.handover(at(12 + MAX_WAIT_MESSAGES + 1), t), None);
        let later = t + MAX_WAIT_IDLE + Duration::from_secs(1);
        assert_eq!(
            log.handover(at(13), later),
            None,
            "stopped applying: no waiting"
        );
        // Another stream under way forgets the marks.
        log.set_stream(6, None, t);
        assert_eq!(log.mark_at(4), None);
        // Copies skipped before anything was applied (a restored replica) mark nothing.
        log.mark(13, false, t);
        assert_eq!(log.mark_at(4), None);
        log.push_change(change(0, 4, true));
        log.mark(14, true, t);
        assert_eq!(log.mark_at(5), Some(StreamMark { stream: 6, seq: 14 }));
        // A reader where the copies ended goes on from the position then; one before, not.
        assert_eq!(
            log.handover(StreamMark { stream: 6, seq: 13 }, t),
            Some(Handover::From(4))
        );
        assert_eq!(log.handover(StreamMark { stream: 6, seq: 12 }, t), None);
        log.mark(15, false, t);
        assert_eq!(log.mark_at(5), Some(StreamMark { stream: 6, seq: 15 }));
    }

    #[test]
    fn a_restored_replica_asks_a_reader_ahead_of_it_to_wait_then_takes_it_over() {
        let t = Instant::now();
        let mut log = FeedLog::new(2, 100, 1 << 20);
        // Started, consumer not open yet: wait, for a while.
        assert_eq!(log.handover(at(30), t), None, "not an index replica");
        log.expect_stream(t);
        assert_eq!(log.handover(at(30), t), Some(Handover::Wait));
        let later = t + MAX_WAIT_IDLE + Duration::from_secs(1);
        assert_eq!(log.handover(at(30), later), None, "the consumer never came");
        // Its state file held messages through 20 at least: the durable goes on after 20.
        log.set_stream(5, Some(20), t);
        assert_eq!(log.handover(at(30), t), Some(Handover::Wait));
        assert_eq!(
            log.handover(at(19), t),
            None,
            "behind the state file: snapshot"
        );
        // 21 and 22 were in the state file after all (copies); 23 on are applied.
        log.push_op(Op::WorkerGone { id: WorkerId(9) }); // a local change, position 0
        log.mark(21, false, t);
        log.mark(22, false, t);
        assert_eq!(
            log.handover(at(21), t),
            None,
            "the state holds 22, the log does not"
        );
        assert_eq!(
            log.handover(at(22), t),
            Some(Handover::Wait),
            "22 may be its end"
        );
        assert_eq!(log.handover(at(30), t), Some(Handover::Wait));
        for seq in 23..=29 {
            log.push_change(change(0, seq, true));
            log.mark(seq, true, t);
        }
        assert_eq!(log.handover(at(30), t), Some(Handover::Wait));
        log.push_change(change(0, 30, true));
        log.mark(30, true, t);
        // Messages 23..=30 are at positions 1..9: the reader at 30 goes on from 9, one at
        // 22 (where the state file ended) from 1, one at 20 or 21 nowhere.
        assert_eq!(log.handover(at(30), t), Some(Handover::From(9)));
        assert_eq!(log.handover(at(26), t), Some(Handover::From(5)));
        assert_eq!(log.handover(at(22), t), Some(Handover::From(1)));
        assert_eq!(log.handover(at(21), t), None);
        assert_eq!(log.handover(at(31), later), None, "idle: no waiting");
    }

    #[test]
    fn marks_whose_entries_left_the_log_hand_over_nothing() {
        let t = Instant::now();
        let mut log = FeedLog::new(1, 4, 1 << 20);
        log.set_stream(5, Some(0), t);
        for seq in 1..=10 {
            log.push_change(change(0, seq, true));
            log.mark(seq, true, t);
        }
        // The log holds positions 6..10; marks stay bounded by it (one before its start).
        assert!(log.marks.len() <= 6, "{} marks", log.marks.len());
        assert_eq!(log.handover(at(5), t), None, "position 5 is before the log");
        assert_eq!(log.handover(at(6), t), Some(Handover::From(6)));
        assert_eq!(log.mark_at(6), Some(at(6)));
        let Reply::Page(b) = log.reply(Some(1), Some(6)) else {
            panic!()
        };
        assert_eq!(Page::decode(&b).unwrap().cursor, 10);
    }
}
