//! Bucket values: a bucket's block keys and their holders, read in place on the request path
//! ([`BucketRef`]) and rewritten as rows by the lease holder ([`BucketRows`]).

use crate::codec::{le_u16, le_u64, Reader};
use crate::event::{Tier, WorkerId};
use crate::lookup::TierMask;
use crate::scope::BlockKey;

use super::keys::LAYOUT_VERSION;

/// A bucket value, read in place.
///
/// # Layout
///
/// ```text
/// version u8 = LAYOUT_VERSION
/// stamp   u32        the index build this bucket belongs to
/// n       u16        entries (distinct block keys)
/// keys    n × u64    sorted ascending
/// ends    n × u16    cumulative end of each entry's holders
/// holders m × (slot u16, tier mask u8)   m = ends[n-1], sorted by slot within an entry
/// ```
#[derive(Clone, Copy, Debug)]
pub struct BucketRef<'a> {
    n: usize,
    keys: &'a [u8],
    ends: &'a [u8],
    holders: &'a [u8],
}

impl<'a> BucketRef<'a> {
    /// Parses a bucket of build `stamp`; a bucket of another build, another layout or a
    /// damaged one reads as `None` (empty).
    pub fn parse(bytes: &'a [u8], stamp: u32) -> Option<BucketRef<'a>> {
        let mut r = Reader::new(bytes);
        if r.u8().ok()? != LAYOUT_VERSION || r.u32().ok()? != stamp {
            return None;
        }
        let n = r.u16().ok()? as usize;
        let keys = r.take(n * 8).ok()?;
        let ends = r.take(n * 2).ok()?;
        let m = if n == 0 {
            0
        } else {
            le_u16(ends, (n - 1) * 2) as usize
        };
        let holders = r.take(m * 3).ok()?;
        if r.position() != bytes.len() {
            return None;
        }
        Some(BucketRef {
            n,
            keys,
            ends,
            holders,
        })
    }

    /// Distinct block keys in the bucket.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether the bucket holds no key.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn key_at(&self, i: usize) -> u64 {
        le_u64(self.keys, i * 8)
    }

    fn find(&self, key: u64) -> Option<usize> {
        let (mut lo, mut hi) = (0usize, self.n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let k = self.key_at(mid);
            if k == key {
                return Some(mid);
            }
            if k < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        None
    }

    fn range(&self, i: usize) -> (usize, usize) {
        let start = if i == 0 {
            0
        } else {
            le_u16(self.ends, (i - 1) * 2) as usize
        };
        let end = le_u16(self.ends, i * 2) as usize;
        (start, end.max(start))
    }

    /// Appends the holders of `key` to `out`.
    pub fn holders_into(&self, key: BlockKey, out: &mut Vec<(WorkerId, TierMask)>) {
        if let Some(i) = self.find(key.0) {
            let (s, e) = self.range(i);
            for h in s..e {
                if let Some(b) = self.holders.get(h * 3..h * 3 + 3) {
                    out.push((
                        WorkerId(u16::from_le_bytes([b[0], b[1]]) as u32),
                        TierMask(b[2]),
                    ));
                }
            }
        }
    }

    /// Every row, in order.
    pub fn rows(&self) -> impl Iterator<Item = Row> + '_ {
        (0..self.n).flat_map(move |i| {
            let key = self.key_at(i);
            let (s, e) = self.range(i);
            (s..e).filter_map(move |h| {
                self.holders.get(h * 3..h * 3 + 3).map(|b| Row {
                    key: BlockKey(key),
                    slot: u16::from_le_bytes([b[0], b[1]]),
                    tiers: TierMask(b[2]),
                })
            })
        })
    }
}

/// One worker slot's hold of one block key, in a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// The block.
    pub key: BlockKey,
    /// The worker slot holding it.
    pub slot: u16,
    /// The tiers it holds it in.
    pub tiers: TierMask,
}

impl Row {
    fn id(&self) -> (u64, u16) {
        (self.key.0, self.slot)
    }
}

/// A bucket being rewritten by the lease holder: one row per `(key, slot)`, sorted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BucketRows {
    rows: Vec<Row>,
    keys: usize,
}

impl BucketRows {
    /// The rows of a parsed bucket (none for a missing one).
    pub fn from_ref(b: Option<BucketRef<'_>>) -> BucketRows {
        match b {
            Some(b) => BucketRows {
                rows: b.rows().collect(),
                keys: b.len(),
            },
            None => BucketRows::default(),
        }
    }

    /// Distinct keys.
    pub fn keys(&self) -> usize {
        self.keys
    }

    /// The rows, sorted by key, then slot.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// Adds tier `tier` to `slot`'s hold of `key`. Returns `false` (and changes nothing) when
    /// the key is new and the bucket already has `max_keys` keys, or the holder area is full.
    pub fn add(&mut self, key: BlockKey, slot: u16, tier: Tier, max_keys: u16) -> bool {
        let bit = TierMask::of(tier).0;
        let key = key.0;
        match self.rows.binary_search_by(|r| r.id().cmp(&(key, slot))) {
            Ok(i) => {
                self.rows[i].tiers.0 |= bit;
                true
            }
            Err(i) => {
                let has_key = (i > 0 && self.rows[i - 1].key.0 == key)
                    || (i < self.rows.len() && self.rows[i].key.0 == key);
                let new_key = !has_key;
                if (new_key && self.keys >= max_keys as usize)
                    || self.rows.len() >= u16::MAX as usize
                {
                    return false;
                }
                self.rows.insert(
                    i,
                    Row {
                        key: BlockKey(key),
                        slot,
                        tiers: TierMask(bit),
                    },
                );
                if new_key {
                    self.keys += 1;
                }
                true
            }
        }
    }

    /// Removes tier `tier` from `slot`'s hold of `key`; a hold left with no tier goes.
    pub fn remove(&mut self, key: BlockKey, slot: u16, tier: Tier) {
        let key = key.0;
        if let Ok(i) = self.rows.binary_search_by(|r| r.id().cmp(&(key, slot))) {
            self.rows[i].tiers = self.rows[i].tiers.without(tier);
            if self.rows[i].tiers.is_empty() {
                self.rows.remove(i);
                let still = (i > 0 && self.rows[i - 1].key.0 == key)
                    || (i < self.rows.len() && self.rows[i].key.0 == key);
                if !still {
                    self.keys -= 1;
                }
            }
        }
    }

    /// Drops every hold of `slot` (its worker went away).
    pub fn remove_slot(&mut self, slot: u16) {
        self.rows.retain(|r| r.slot != slot);
        self.recount();
    }

    fn recount(&mut self) {
        let mut n = 0;
        let mut last = None;
        for r in &self.rows {
            if last != Some(r.key) {
                n += 1;
                last = Some(r.key);
            }
        }
        self.keys = n;
    }

    /// The bucket value for build `stamp`.
    pub fn encode(&self, stamp: u32, out: &mut Vec<u8>) {
        out.clear();
        out.push(LAYOUT_VERSION);
        out.extend_from_slice(&stamp.to_le_bytes());
        out.extend_from_slice(&(self.keys as u16).to_le_bytes());
        let mut last = None;
        for r in &self.rows {
            if last != Some(r.key) {
                out.extend_from_slice(&r.key.0.to_le_bytes());
                last = Some(r.key);
            }
        }
        for (i, r) in self.rows.iter().enumerate() {
            if self.rows.get(i + 1).is_none_or(|n| n.key != r.key) {
                out.extend_from_slice(&((i + 1) as u16).to_le_bytes());
            }
        }
        for r in &self.rows {
            out.extend_from_slice(&r.slot.to_le_bytes());
            out.push(r.tiers.0);
        }
    }
}
