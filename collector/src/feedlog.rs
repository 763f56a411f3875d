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

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvroute::event::{Tier, WorkerId};
use kvroute::feed::{Op, Page};
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
}

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
        }
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
}
