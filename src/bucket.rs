//! The filter's shared-data layout: a bounded keyspace holding a copy of the collector's index.
//!
//! Envoy's shared data is one mutex-guarded map per `vm_id` whose keys are never deleted (ABI
//! 0.2.1 has no delete). So the filter keeps a fixed set of keys, whatever the number of
//! blocks, scopes and workers that come and go:
//!
//! | key | what |
//! |---|---|
//! | `{prefix}/lease` | which VM pulls the feed, until when ([`Lease`]) |
//! | `{prefix}/vmseq` | a counter handing each VM a unique id |
//! | `{prefix}/active` | the sync state: active generation, epoch, cursor, sync time ([`SyncState`]) |
//! | `{prefix}/load` | in-flight requests per worker, with a time-to-live ([`load_get`]) |
//! | `{prefix}/g{0,1}/meta` | worker slots, block sizes, aliases of a generation ([`Meta`]) |
//! | `{prefix}/g{0,1}/b{i:x}` | bucket `i` of a generation's block table ([`BucketRef`]) |
//!
//! `{prefix}` is `kvroute/{plugin name}/v{LAYOUT_VERSION}`, so two plugins (or two layouts after
//! an upgrade) on one `vm_id` never read each other's bytes. The total is
//! `4 + 2 × (1 + buckets)` keys, fixed by configuration.
//!
//! A block lives in bucket `key >> (64 - log2(buckets))` (its [`BlockKey`] is already a hash).
//! Each bucket value carries the *stamp* of the index build it belongs to: a full resync
//! builds a new stamp into the inactive generation, where every bucket still holding an older
//! stamp reads as empty, so nothing has to be cleared first, and switching `active` over
//! swaps the whole index at once.
//!
//! Everything here is pure: the shared data is reached through the [`Store`] trait, which the
//! filter implements over proxy-wasm host calls and tests implement over a map.

use core::cell::{Cell, RefCell};

use crate::event::{Tier, WorkerId};
use crate::feed::{Op, Page};
use crate::lookup::{HolderView, TierMask};
use crate::scope::BlockKey;

/// Version of every value layout below; part of every key name.
pub const LAYOUT_VERSION: u8 = 2;

/// Most attempts at a compare-and-swap update before giving up (the update is then skipped
/// and counted by the caller).
pub const CAS_RETRIES: u32 = 8;

/// Shared data as the filter sees it.
pub trait Store {
    /// The value of `key` (`None` when missing or empty) and its CAS token (0 when missing).
    ///
    /// # Errors
    /// A host failure.
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError>;

    /// Stores `value` under `key`; with `cas != 0`, only if the key's token is still `cas`.
    ///
    /// # Errors
    /// [`StoreError::CasMismatch`] when another writer came first; a host failure otherwise.
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError>;
}

/// Why a shared-data call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Another writer changed the key since it was read.
    #[error("compare-and-swap mismatch")]
    CasMismatch,
    /// The host returned this status.
    #[error("host status {0}")]
    Host(u32),
}

/// Fixed sizes of the layout, from the filter's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// log2 of the number of buckets per generation (0..=20).
    pub buckets_log2: u8,
    /// Worker slots: feed worker ids at or above this are dropped (counted).
    pub max_workers: u32,
    /// Distinct block keys one bucket keeps; adds past it are dropped (counted).
    pub max_bucket_keys: u16,
    /// Block sizes plus aliases one generation keeps; more are dropped (counted).
    pub max_models: u16,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            buckets_log2: 14,
            max_workers: 256,
            max_bucket_keys: 4096,
            max_models: 1024,
        }
    }
}

impl Limits {
    pub fn buckets(&self) -> u32 {
        1u32 << self.buckets_log2.min(20)
    }
}

/// Key names of one plugin's layout.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(plugin: &str) -> Keys {
        Keys {
            prefix: format!("kvroute/{plugin}/v{LAYOUT_VERSION}"),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn lease(&self) -> String {
        format!("{}/lease", self.prefix)
    }

    pub fn vm_seq(&self) -> String {
        format!("{}/vmseq", self.prefix)
    }

    pub fn active(&self) -> String {
        format!("{}/active", self.prefix)
    }

    pub fn load(&self) -> String {
        format!("{}/load", self.prefix)
    }

    pub fn meta(&self, gen: u8) -> String {
        format!("{}/g{}/meta", self.prefix, gen & 1)
    }

    /// Writes the key of bucket `idx` of generation `gen` into `out` (cleared first), so the
    /// request path reuses one buffer.
    pub fn bucket_into(&self, gen: u8, idx: u32, out: &mut String) {
        // Hand-rolled: this runs for every bucket read of the request path, where `write!`'s
        // formatting machinery would cost more than the rest of the key.
        out.clear();
        out.push_str(&self.prefix);
        out.push_str(if gen & 1 == 0 { "/g0/b" } else { "/g1/b" });
        let digits = if idx == 0 {
            1
        } else {
            (32 - idx.leading_zeros()).div_ceil(4)
        };
        for i in (0..digits).rev() {
            let d = (idx >> (i * 4)) & 0xf;
            out.push(char::from_digit(d, 16).unwrap_or('0'));
        }
    }

    pub fn bucket(&self, gen: u8, idx: u32) -> String {
        let mut s = String::new();
        self.bucket_into(gen, idx, &mut s);
        s
    }
}

/// The bucket of a block key: its top `buckets_log2` bits.
#[inline]
pub fn bucket_of(key: BlockKey, buckets_log2: u8) -> u32 {
    let bits = buckets_log2.min(20);
    if bits == 0 {
        0
    } else {
        (key.0 >> (64 - bits as u32)) as u32
    }
}

// ---------------------------------------------------------------------------------------------
// Small byte reader/writer helpers: every read is checked, never a panic.

struct Rd<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Rd<'a> {
    fn new(b: &'a [u8]) -> Self {
        Rd { b, at: 0 }
    }
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.b.get(self.at..end)?;
        self.at = end;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|s| s[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|s| u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Option<u64> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Some(u64::from_le_bytes(a))
    }
    fn str(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        let s = self.take(n)?;
        core::str::from_utf8(s).ok().map(str::to_owned)
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(u16::MAX as usize);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

#[inline]
fn le_u64(b: &[u8], at: usize) -> u64 {
    match b.get(at..at + 8) {
        Some(s) => {
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            u64::from_le_bytes(a)
        }
        None => 0,
    }
}

#[inline]
fn le_u16(b: &[u8], at: usize) -> u16 {
    match b.get(at..at + 2) {
        Some(s) => u16::from_le_bytes([s[0], s[1]]),
        None => 0,
    }
}

// ---------------------------------------------------------------------------------------------
// Buckets

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
        let mut r = Rd::new(bytes);
        if r.u8()? != LAYOUT_VERSION || r.u32()? != stamp {
            return None;
        }
        let n = r.u16()? as usize;
        let keys = r.take(n * 8)?;
        let ends = r.take(n * 2)?;
        let m = if n == 0 {
            0
        } else {
            le_u16(ends, (n - 1) * 2) as usize
        };
        let holders = r.take(m * 3)?;
        if r.at != bytes.len() {
            return None;
        }
        Some(BucketRef {
            n,
            keys,
            ends,
            holders,
        })
    }

    pub fn len(&self) -> usize {
        self.n
    }

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

    /// Every `(key, slot, mask)` row, in order.
    pub fn rows(&self) -> impl Iterator<Item = (u64, u16, u8)> + '_ {
        (0..self.n).flat_map(move |i| {
            let key = self.key_at(i);
            let (s, e) = self.range(i);
            (s..e).filter_map(move |h| {
                self.holders
                    .get(h * 3..h * 3 + 3)
                    .map(|b| (key, u16::from_le_bytes([b[0], b[1]]), b[2]))
            })
        })
    }
}

/// A bucket being rewritten by the lease holder: one row per `(key, slot)`, sorted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BucketRows {
    rows: Vec<(u64, u16, u8)>,
    keys: usize,
}

impl BucketRows {
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

    pub fn rows(&self) -> &[(u64, u16, u8)] {
        &self.rows
    }

    /// Adds tier `tier` to `slot`'s hold of `key`. Returns `false` (and changes nothing) when
    /// the key is new and the bucket already has `max_keys` keys, or the holder area is full.
    pub fn add(&mut self, key: u64, slot: u16, tier: Tier, max_keys: u16) -> bool {
        let bit = TierMask::of(tier).0;
        match self.rows.binary_search_by(|r| (r.0, r.1).cmp(&(key, slot))) {
            Ok(i) => {
                self.rows[i].2 |= bit;
                true
            }
            Err(i) => {
                let has_key = (i > 0 && self.rows[i - 1].0 == key)
                    || (i < self.rows.len() && self.rows[i].0 == key);
                let new_key = !has_key;
                if (new_key && self.keys >= max_keys as usize)
                    || self.rows.len() >= u16::MAX as usize
                {
                    return false;
                }
                self.rows.insert(i, (key, slot, bit));
                if new_key {
                    self.keys += 1;
                }
                true
            }
        }
    }

    /// Removes tier `tier` from `slot`'s hold of `key`; a hold left with no tier goes.
    pub fn remove(&mut self, key: u64, slot: u16, tier: Tier) {
        if let Ok(i) = self.rows.binary_search_by(|r| (r.0, r.1).cmp(&(key, slot))) {
            self.rows[i].2 &= !TierMask::of(tier).0;
            if self.rows[i].2 & 0b111 == 0 {
                self.rows.remove(i);
                let still = (i > 0 && self.rows[i - 1].0 == key)
                    || (i < self.rows.len() && self.rows[i].0 == key);
                if !still {
                    self.keys -= 1;
                }
            }
        }
    }

    /// Drops every hold of `slot` (its worker went away).
    pub fn remove_slot(&mut self, slot: u16) {
        self.rows.retain(|r| r.1 != slot);
        self.recount();
    }

    fn recount(&mut self) {
        let mut n = 0;
        let mut last = None;
        for r in &self.rows {
            if last != Some(r.0) {
                n += 1;
                last = Some(r.0);
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
            if last != Some(r.0) {
                out.extend_from_slice(&r.0.to_le_bytes());
                last = Some(r.0);
            }
        }
        for (i, r) in self.rows.iter().enumerate() {
            if self.rows.get(i + 1).is_none_or(|n| n.0 != r.0) {
                out.extend_from_slice(&((i + 1) as u16).to_le_bytes());
            }
        }
        for r in &self.rows {
            out.extend_from_slice(&r.1.to_le_bytes());
            out.push(r.2);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Meta: worker slots, block sizes, aliases

/// One worker slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSlot {
    pub live: bool,
    pub dp_rank: u32,
    pub instance_id: String,
    pub address: String,
    /// The registration's tenant and model: a request is routed only to its model's workers
    /// (empty: unknown, a candidate for any model).
    pub tenant: String,
    pub model: String,
}

/// A served name's resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alias {
    pub tenant: String,
    pub served: String,
    pub model: String,
    pub lora: Option<String>,
}

/// A generation's worker table, block sizes and aliases.
///
/// # Layout
///
/// ```text
/// version u8, stamp u32
/// nw u16, nw × (slot u16, live u8, dp_rank u32, instance str, address str, tenant str, model str)
/// ns u16, ns × (tenant str, model str, block_size u32)
/// na u16, na × (tenant str, served str, model str, lora str ("" = none))
/// str = len u16, UTF-8 bytes
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    /// Indexed by slot (= the feed's worker id); `None` is a free slot.
    pub workers: Vec<Option<WorkerSlot>>,
    pub block_sizes: Vec<(String, String, u32)>,
    pub aliases: Vec<Alias>,
}

/// Counts of what a page did, for the filter's metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Block holds added or removed.
    pub blocks: u64,
    /// Bucket values written.
    pub bucket_writes: u64,
    /// Block adds dropped because a bucket was full.
    pub bucket_full: u64,
    /// Ops naming a worker id at or above `max_workers`.
    pub bad_workers: u64,
    /// Block sizes or aliases dropped past `max_models`.
    pub models_dropped: u64,
}

impl Meta {
    pub fn decode(bytes: &[u8], stamp: u32) -> Option<Meta> {
        let mut r = Rd::new(bytes);
        if r.u8()? != LAYOUT_VERSION || r.u32()? != stamp {
            return None;
        }
        let mut m = Meta::default();
        for _ in 0..r.u16()? {
            let slot = r.u16()? as usize;
            let live = r.u8()? != 0;
            let dp_rank = r.u32()?;
            let instance_id = r.str()?;
            let address = r.str()?;
            let tenant = r.str()?;
            let model = r.str()?;
            if m.workers.len() <= slot {
                m.workers.resize(slot + 1, None);
            }
            m.workers[slot] = Some(WorkerSlot {
                live,
                dp_rank,
                instance_id,
                address,
                tenant,
                model,
            });
        }
        for _ in 0..r.u16()? {
            let t = r.str()?;
            let model = r.str()?;
            let bs = r.u32()?;
            m.block_sizes.push((t, model, bs));
        }
        for _ in 0..r.u16()? {
            let tenant = r.str()?;
            let served = r.str()?;
            let model = r.str()?;
            let lora = r.str()?;
            m.aliases.push(Alias {
                tenant,
                served,
                model,
                lora: (!lora.is_empty()).then_some(lora),
            });
        }
        (r.at == bytes.len()).then_some(m)
    }

    pub fn encode(&self, stamp: u32) -> Vec<u8> {
        let mut out = vec![LAYOUT_VERSION];
        out.extend_from_slice(&stamp.to_le_bytes());
        let live: Vec<(usize, &WorkerSlot)> = self
            .workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.as_ref().map(|w| (i, w)))
            .collect();
        out.extend_from_slice(&(live.len() as u16).to_le_bytes());
        for (slot, w) in live {
            out.extend_from_slice(&(slot as u16).to_le_bytes());
            out.push(w.live as u8);
            out.extend_from_slice(&w.dp_rank.to_le_bytes());
            put_str(&mut out, &w.instance_id);
            put_str(&mut out, &w.address);
            put_str(&mut out, &w.tenant);
            put_str(&mut out, &w.model);
        }
        out.extend_from_slice(&(self.block_sizes.len() as u16).to_le_bytes());
        for (t, m, bs) in &self.block_sizes {
            put_str(&mut out, t);
            put_str(&mut out, m);
            out.extend_from_slice(&bs.to_le_bytes());
        }
        out.extend_from_slice(&(self.aliases.len() as u16).to_le_bytes());
        for a in &self.aliases {
            put_str(&mut out, &a.tenant);
            put_str(&mut out, &a.served);
            put_str(&mut out, &a.model);
            put_str(&mut out, a.lora.as_deref().unwrap_or(""));
        }
        out
    }

    /// The block size of `(tenant, model)`.
    pub fn block_size(&self, tenant: &str, model: &str) -> Option<u32> {
        self.block_sizes
            .iter()
            .find(|(t, m, _)| t == tenant && m == model)
            .map(|e| e.2)
    }

    /// Resolves a served model name: `(model, lora)`; a name without alias is itself.
    pub fn resolve<'a>(&'a self, tenant: &str, served: &'a str) -> (&'a str, Option<&'a str>) {
        match self
            .aliases
            .iter()
            .find(|a| a.tenant == tenant && a.served == served)
        {
            Some(a) => (&a.model, a.lora.as_deref()),
            None => (served, None),
        }
    }

    pub fn worker(&self, slot: u32) -> Option<&WorkerSlot> {
        self.workers.get(slot as usize).and_then(Option::as_ref)
    }

    /// Applies one non-block op. Returns whether anything changed.
    fn apply(&mut self, op: &Op, limits: &Limits, stats: &mut ApplyStats) -> bool {
        match op {
            Op::Worker {
                id,
                live,
                dp_rank,
                instance_id,
                address,
                tenant,
                model,
            } => {
                if id.0 >= limits.max_workers {
                    stats.bad_workers += 1;
                    return false;
                }
                let slot = id.0 as usize;
                if self.workers.len() <= slot {
                    self.workers.resize(slot + 1, None);
                }
                let w = WorkerSlot {
                    live: *live,
                    dp_rank: *dp_rank,
                    instance_id: instance_id.clone(),
                    address: address.clone(),
                    tenant: tenant.clone(),
                    model: model.clone(),
                };
                let changed = self.workers[slot].as_ref() != Some(&w);
                self.workers[slot] = Some(w);
                changed
            }
            Op::WorkerGone { id } => match self.workers.get_mut(id.0 as usize) {
                Some(w) if w.is_some() => {
                    *w = None;
                    true
                }
                _ => false,
            },
            Op::BlockSize {
                tenant,
                model,
                block_size,
            } => {
                if let Some(e) = self
                    .block_sizes
                    .iter_mut()
                    .find(|(t, m, _)| t == tenant && m == model)
                {
                    let changed = e.2 != *block_size;
                    e.2 = *block_size;
                    return changed;
                }
                if self.block_sizes.len() + self.aliases.len() >= limits.max_models as usize {
                    stats.models_dropped += 1;
                    return false;
                }
                self.block_sizes
                    .push((tenant.clone(), model.clone(), *block_size));
                true
            }
            Op::Alias {
                tenant,
                served,
                model,
                lora,
            } => {
                let a = Alias {
                    tenant: tenant.clone(),
                    served: served.clone(),
                    model: model.clone(),
                    lora: lora.clone(),
                };
                if let Some(e) = self
                    .aliases
                    .iter_mut()
                    .find(|a| &a.tenant == tenant && &a.served == served)
                {
                    let changed = *e != a;
                    *e = a;
                    return changed;
                }
                if self.block_sizes.len() + self.aliases.len() >= limits.max_models as usize {
                    stats.models_dropped += 1;
                    return false;
                }
                self.aliases.push(a);
                true
            }
            Op::Blocks { .. } => false,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sync state and lease

/// A full resync in progress, built into the inactive generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Build {
    pub gen: u8,
    pub stamp: u32,
    pub epoch: u64,
    pub cursor: u64,
}

/// What `{prefix}/active` holds.
///
/// # Layout
///
/// ```text
/// version u8, flags u8 (bit 0 has_index, bit 1 building, bit 2 cursor valid)
/// gen u8, stamp u32, meta_version u32, next_stamp u32, epoch u64, cursor u64, synced_at_ms u64
/// build: gen u8, stamp u32, epoch u64, cursor u64
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncState {
    /// An index has been switched in at least once.
    pub has_index: bool,
    /// The generation readers use.
    pub gen: u8,
    pub stamp: u32,
    /// Bumped whenever the active generation's [`Meta`] changes, so readers re-read it.
    pub meta_version: u32,
    /// The next build stamp to hand out (stamps never repeat).
    pub next_stamp: u32,
    /// Feed epoch and cursor of the active generation; `cursor_valid == false` asks for a
    /// full snapshot.
    pub epoch: u64,
    pub cursor: u64,
    pub cursor_valid: bool,
    /// When the active generation last caught up with the collector (host clock, ms).
    pub synced_at_ms: u64,
    pub build: Option<Build>,
}

impl SyncState {
    pub fn decode(b: &[u8]) -> Option<SyncState> {
        let mut r = Rd::new(b);
        if r.u8()? != LAYOUT_VERSION {
            return None;
        }
        let flags = r.u8()?;
        let mut s = SyncState {
            has_index: flags & 1 != 0,
            cursor_valid: flags & 4 != 0,
            gen: r.u8()? & 1,
            stamp: r.u32()?,
            meta_version: r.u32()?,
            next_stamp: r.u32()?,
            epoch: r.u64()?,
            cursor: r.u64()?,
            synced_at_ms: r.u64()?,
            build: None,
        };
        let build = Build {
            gen: r.u8()? & 1,
            stamp: r.u32()?,
            epoch: r.u64()?,
            cursor: r.u64()?,
        };
        if flags & 2 != 0 {
            s.build = Some(build);
        }
        Some(s)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.push(LAYOUT_VERSION);
        out.push(
            self.has_index as u8
                | (self.build.is_some() as u8) << 1
                | (self.cursor_valid as u8) << 2,
        );
        out.push(self.gen);
        out.extend_from_slice(&self.stamp.to_le_bytes());
        out.extend_from_slice(&self.meta_version.to_le_bytes());
        out.extend_from_slice(&self.next_stamp.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.cursor.to_le_bytes());
        out.extend_from_slice(&self.synced_at_ms.to_le_bytes());
        let b = self.build.unwrap_or_default();
        out.push(b.gen);
        out.extend_from_slice(&b.stamp.to_le_bytes());
        out.extend_from_slice(&b.epoch.to_le_bytes());
        out.extend_from_slice(&b.cursor.to_le_bytes());
        out
    }

    /// The query string of the next `/v1/feed` pull (`?epoch=E&since=C`, or empty to ask for
    /// a full snapshot).
    pub fn feed_query(&self) -> String {
        match self.build {
            Some(b) => format!("?epoch={}&since={}", b.epoch, b.cursor),
            None if self.has_index && self.cursor_valid => {
                format!("?epoch={}&since={}", self.epoch, self.cursor)
            }
            None => String::new(),
        }
    }

    /// Whether the active index is too old to route on.
    pub fn is_stale(&self, now_ms: u64, stale_after_ms: u64) -> bool {
        !self.has_index || now_ms.saturating_sub(self.synced_at_ms) > stale_after_ms
    }
}

/// The sync lease.
///
/// # Layout
/// `version u8, holder u64, expires_ms u64`
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lease {
    pub holder: u64,
    pub expires_ms: u64,
}

impl Lease {
    pub fn decode(b: &[u8]) -> Option<Lease> {
        let mut r = Rd::new(b);
        if r.u8()? != LAYOUT_VERSION {
            return None;
        }
        Some(Lease {
            holder: r.u64()?,
            expires_ms: r.u64()?,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![LAYOUT_VERSION];
        out.extend_from_slice(&self.holder.to_le_bytes());
        out.extend_from_slice(&self.expires_ms.to_le_bytes());
        out
    }
}

/// Takes or renews the lease for VM `me` until `now_ms + duration_ms`: succeeds when the lease
/// is free, lapsed or already `me`'s, and the CAS write wins.
///
/// # Errors
/// A host failure; a lost race is `Ok(false)`.
pub fn acquire_lease<S: Store>(
    store: &S,
    keys: &Keys,
    me: u64,
    now_ms: u64,
    duration_ms: u64,
) -> Result<bool, StoreError> {
    let key = keys.lease();
    let (value, cas) = store.get(&key)?;
    let current = value.as_deref().and_then(Lease::decode);
    if let Some(l) = current {
        if l.holder != me && l.expires_ms > now_ms {
            return Ok(false);
        }
    }
    let lease = Lease {
        holder: me,
        expires_ms: now_ms.saturating_add(duration_ms),
    };
    // With no key yet, cas is 0 and the write is unconditional: two VMs may both "win" that
    // first race, and the next renewal (a CAS) settles it.
    match store.set(&key, &lease.encode(), cas) {
        Ok(()) => Ok(true),
        Err(StoreError::CasMismatch) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Hands out a unique VM id from the shared counter.
///
/// # Errors
/// A host failure, or [`StoreError::CasMismatch`] after [`CAS_RETRIES`] lost races.
pub fn next_vm_id<S: Store>(store: &S, keys: &Keys) -> Result<u64, StoreError> {
    let key = keys.vm_seq();
    for _ in 0..CAS_RETRIES {
        let (value, cas) = store.get(&key)?;
        let n = value.as_deref().map(|v| le_u64(v, 0)).unwrap_or(0) + 1;
        match store.set(&key, &n.to_le_bytes(), cas) {
            Ok(()) => return Ok(n),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// Reads the sync state (default when missing or unreadable) and its CAS token.
///
/// # Errors
/// A host failure.
pub fn read_state<S: Store>(store: &S, keys: &Keys) -> Result<(SyncState, u32), StoreError> {
    let (value, cas) = store.get(&keys.active())?;
    Ok((
        value
            .as_deref()
            .and_then(SyncState::decode)
            .unwrap_or_default(),
        cas,
    ))
}

/// Why a page was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SyncError {
    /// A delta page of an epoch other than the one being followed: the cursor is dropped so
    /// the next pull asks for a full snapshot.
    #[error("delta page of epoch {got}, following {want}")]
    EpochMismatch { got: u64, want: u64 },
    /// A delta page before any snapshot.
    #[error("delta page with no index to apply it to")]
    NoBase,
    /// Shared data failed.
    #[error("shared data: {0}")]
    Store(#[from] StoreError),
}

/// What applying a page did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub stats: ApplyStats,
    /// A full resync was switched in by this page.
    pub switched: bool,
    /// The page asked for another pull at once.
    pub more: bool,
}

/// Applies one feed page to shared data: the lease holder's whole job.
///
/// A `RESET` page starts a new build in the inactive generation; pages of a build go there
/// until one without `MORE` switches it in. Delta pages go to the active generation. The
/// ops of a page are grouped by bucket, so each touched bucket is read and written once.
///
/// # Errors
/// [`SyncError`]; on an epoch mismatch the state is already reset for a snapshot.
pub fn apply_page<S: Store>(
    store: &S,
    keys: &Keys,
    limits: &Limits,
    page: &Page,
    now_ms: u64,
) -> Result<Applied, SyncError> {
    let (mut state, cas) = read_state(store, keys)?;
    let mut out = Applied {
        more: page.has_more(),
        ..Applied::default()
    };
    let (gen, stamp) = if page.is_reset() {
        let gen = if state.has_index { state.gen ^ 1 } else { 0 };
        let stamp = state.next_stamp.max(state.stamp).wrapping_add(1).max(1);
        state.next_stamp = stamp;
        state.build = Some(Build {
            gen,
            stamp,
            epoch: page.epoch,
            cursor: page.cursor,
        });
        (gen, stamp)
    } else if let Some(b) = state.build {
        if b.epoch != page.epoch {
            state.build = None;
            state.cursor_valid = false;
            write_state(store, keys, &state, cas)?;
            return Err(SyncError::EpochMismatch {
                got: page.epoch,
                want: b.epoch,
            });
        }
        (b.gen, b.stamp)
    } else if state.has_index && state.cursor_valid {
        if state.epoch != page.epoch {
            state.cursor_valid = false;
            write_state(store, keys, &state, cas)?;
            return Err(SyncError::EpochMismatch {
                got: page.epoch,
                want: state.epoch,
            });
        }
        (state.gen, state.stamp)
    } else {
        return Err(SyncError::NoBase);
    };

    // Meta ops.
    let meta_key = keys.meta(gen);
    let mut meta = if page.is_reset() {
        Meta::default()
    } else {
        store
            .get(&meta_key)?
            .0
            .as_deref()
            .and_then(|b| Meta::decode(b, stamp))
            .unwrap_or_default()
    };
    let mut meta_changed = page.is_reset();
    for op in &page.ops {
        meta_changed |= meta.apply(op, limits, &mut out.stats);
    }

    // Block ops, grouped by bucket (a stable sort keeps each bucket's ops in page order).
    let mut ops: Vec<(u32, u64, u16, Tier, bool)> = Vec::new();
    for op in &page.ops {
        if let Op::Blocks {
            worker,
            tier,
            added,
            keys: bkeys,
        } = op
        {
            if worker.0 >= limits.max_workers {
                out.stats.bad_workers += 1;
                continue;
            }
            for k in bkeys {
                ops.push((
                    bucket_of(*k, limits.buckets_log2),
                    k.0,
                    worker.0 as u16,
                    *tier,
                    *added,
                ));
            }
        }
    }
    ops.sort_by_key(|o| o.0);
    let mut key_buf = String::new();
    let mut val_buf = Vec::new();
    let mut i = 0;
    while i < ops.len() {
        let b = ops[i].0;
        keys.bucket_into(gen, b, &mut key_buf);
        let current = store.get(&key_buf)?.0;
        let mut rows =
            BucketRows::from_ref(current.as_deref().and_then(|v| BucketRef::parse(v, stamp)));
        while i < ops.len() && ops[i].0 == b {
            let (_, key, slot, tier, added) = ops[i];
            if added {
                if !rows.add(key, slot, tier, limits.max_bucket_keys) {
                    out.stats.bucket_full += 1;
                }
            } else {
                rows.remove(key, slot, tier);
            }
            out.stats.blocks += 1;
            i += 1;
        }
        rows.encode(stamp, &mut val_buf);
        store.set(&key_buf, &val_buf, 0)?;
        out.stats.bucket_writes += 1;
    }
    // The feed removes a worker's blocks before its WorkerGone: no sweep of the buckets here.

    if meta_changed {
        store.set(&meta_key, &meta.encode(stamp), 0)?;
    }

    match state.build {
        Some(mut b) => {
            b.cursor = page.cursor;
            b.epoch = page.epoch;
            if page.has_more() {
                state.build = Some(b);
            } else {
                // Caught up: switch the build in whole.
                state.has_index = true;
                state.gen = b.gen;
                state.stamp = b.stamp;
                state.epoch = b.epoch;
                state.cursor = b.cursor;
                state.cursor_valid = true;
                state.meta_version = state.meta_version.wrapping_add(1);
                state.synced_at_ms = now_ms;
                state.build = None;
                out.switched = true;
            }
        }
        None => {
            state.cursor = page.cursor;
            if meta_changed {
                state.meta_version = state.meta_version.wrapping_add(1);
            }
            if !page.has_more() {
                state.synced_at_ms = now_ms;
            }
        }
    }
    write_state(store, keys, &state, cas)?;
    Ok(out)
}

/// Records that the collector answered with nothing new (an empty page is applied the same
/// way); kept for callers that learn freshness some other way.
fn write_state<S: Store>(
    store: &S,
    keys: &Keys,
    state: &SyncState,
    cas: u32,
) -> Result<(), StoreError> {
    store.set(&keys.active(), &state.encode(), cas)
}

// ---------------------------------------------------------------------------------------------
// Request-side view

/// The request path's view of the active generation: a [`HolderView`] over the buckets that
/// counts its reads.
#[derive(Debug)]
pub struct BucketView<'a, S: Store> {
    store: &'a S,
    keys: &'a Keys,
    gen: u8,
    stamp: u32,
    buckets_log2: u8,
    key_buf: RefCell<String>,
    reads: Cell<u32>,
    errors: Cell<u32>,
}

impl<'a, S: Store> BucketView<'a, S> {
    pub fn new(store: &'a S, keys: &'a Keys, state: &SyncState, buckets_log2: u8) -> Self {
        BucketView {
            store,
            keys,
            gen: state.gen,
            stamp: state.stamp,
            buckets_log2,
            key_buf: RefCell::new(String::with_capacity(keys.prefix().len() + 16)),
            reads: Cell::new(0),
            errors: Cell::new(0),
        }
    }

    /// Shared-data reads so far.
    pub fn reads(&self) -> u32 {
        self.reads.get()
    }

    /// Failed reads so far (each read as empty).
    pub fn errors(&self) -> u32 {
        self.errors.get()
    }
}

impl<S: Store> HolderView for BucketView<'_, S> {
    fn holders(&self, key: BlockKey, out: &mut Vec<(WorkerId, TierMask)>) {
        let Ok(mut buf) = self.key_buf.try_borrow_mut() else {
            return;
        };
        self.keys
            .bucket_into(self.gen, bucket_of(key, self.buckets_log2), &mut buf);
        self.reads.set(self.reads.get() + 1);
        match self.store.get(&buf) {
            Ok((Some(v), _)) => {
                if let Some(b) = BucketRef::parse(&v, self.stamp) {
                    b.holders_into(key, out);
                }
            }
            Ok((None, _)) => {}
            Err(_) => self.errors.set(self.errors.get() + 1),
        }
    }
}

/// A [`HolderView`] over a prompt that hashes lazily: the walk is given the *depths*
/// `BlockKey(0), BlockKey(1), ...` (see [`depth_keys`]) and this view computes sequence hashes
/// only up to the deepest depth it is asked about, and a block key only for the depths it
/// reads. A prompt whose first block nobody holds costs one block hash; a full match costs the
/// chain of block hashes but only `reads` key hashes instead of one per block.
#[derive(Debug)]
pub struct PrefixView<'a, S: Store> {
    inner: BucketView<'a, S>,
    tokens: &'a [u32],
    block_size: usize,
    seed: u64,
    scope: crate::scope::ScopeId,
    seqs: RefCell<Vec<crate::hash::SeqHash>>,
}

impl<'a, S: Store> PrefixView<'a, S> {
    /// `seqs` is a reusable buffer (cleared here); get it back with [`PrefixView::into_seqs`].
    pub fn new(
        inner: BucketView<'a, S>,
        tokens: &'a [u32],
        block_size: usize,
        seed: u64,
        scope: crate::scope::ScopeId,
        mut seqs: Vec<crate::hash::SeqHash>,
    ) -> Self {
        seqs.clear();
        PrefixView {
            inner,
            tokens,
            block_size: block_size.max(1),
            seed,
            scope,
            seqs: RefCell::new(seqs),
        }
    }

    /// Full blocks of the prompt: the length of the depth list to walk.
    pub fn blocks(&self) -> usize {
        self.tokens.len() / self.block_size
    }

    /// Blocks hashed so far.
    pub fn hashed(&self) -> usize {
        self.seqs.borrow().len()
    }

    pub fn reads(&self) -> u32 {
        self.inner.reads()
    }

    pub fn into_seqs(self) -> Vec<crate::hash::SeqHash> {
        self.seqs.into_inner()
    }

    /// The sequence hash at `depth`, extending the chain as needed.
    fn seq_at(&self, depth: usize) -> Option<crate::hash::SeqHash> {
        let mut seqs = self.seqs.try_borrow_mut().ok()?;
        while seqs.len() <= depth {
            let i = seqs.len();
            let block = self
                .tokens
                .get(i * self.block_size..(i + 1) * self.block_size)?;
            let parent = seqs.last().copied();
            seqs.push(crate::hash::chain(
                parent,
                crate::hash::block_hash(block, self.seed),
            ));
        }
        seqs.get(depth).copied()
    }
}

impl<S: Store> HolderView for PrefixView<'_, S> {
    fn holders(&self, depth: BlockKey, out: &mut Vec<(WorkerId, TierMask)>) {
        if let Some(seq) = self.seq_at(depth.0 as usize) {
            self.inner.holders(self.scope.key(seq), out);
        }
    }
}

/// Fills `out` with the depths `BlockKey(0) .. BlockKey(n)`: the "keys" a [`PrefixView`] walk
/// is given.
pub fn depth_keys(n: usize, out: &mut Vec<BlockKey>) {
    if out.len() > n {
        out.truncate(n);
    }
    for i in out.len()..n {
        out.push(BlockKey(i as u64));
    }
    // Earlier fills wrote the same values: nothing to rewrite below `out.len()`.
}

// ---------------------------------------------------------------------------------------------
// In-flight load

/// In-flight load of one worker (local mode: a slot; remote mode: an instance).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    pub requests: u32,
    pub prefill_tokens: u32,
}

const LOAD_ENTRY: usize = 24;

/// The load of `id` (nonzero) in a load table value: zero when absent or not updated for
/// `ttl_ms` (a VM that died never releases its counts; the time-to-live forgets them).
///
/// # Layout
/// `version u8`, then `capacity × (id u64, requests u32, prefill_tokens u32, updated_ms u64)`,
/// open addressing from `id % capacity`; id 0 is a free entry.
pub fn load_get(table: &[u8], id: u64, now_ms: u64, ttl_ms: u64) -> Load {
    match load_find(table, id) {
        Some((at, true)) => {
            let updated = le_u64(table, at + 16);
            if now_ms.saturating_sub(updated) > ttl_ms {
                Load::default()
            } else {
                Load {
                    requests: le_u64(table, at + 8) as u32,
                    prefill_tokens: (le_u64(table, at + 8) >> 32) as u32,
                }
            }
        }
        _ => Load::default(),
    }
}

/// Finds `id`'s entry: `(offset, true)`, or the first free entry `(offset, false)`.
fn load_find(table: &[u8], id: u64) -> Option<(usize, bool)> {
    if table.first() != Some(&LAYOUT_VERSION) || id == 0 {
        return None;
    }
    let cap = (table.len() - 1) / LOAD_ENTRY;
    if cap == 0 {
        return None;
    }
    let start = (id % cap as u64) as usize;
    let mut free = None;
    for p in 0..cap {
        let at = 1 + ((start + p) % cap) * LOAD_ENTRY;
        let e = le_u64(table, at);
        if e == id {
            return Some((at, true));
        }
        if e == 0 {
            return Some((free.unwrap_or(at), false));
        }
        if free.is_none() && le_u64(table, at + 8) == 0 {
            // An entry with nothing in flight can be reused.
            free = Some(at);
        }
    }
    free.map(|at| (at, false))
}

/// Adds `requests` and `prefill_tokens` (negative to release) to `id`'s load in `table`
/// (made with `capacity` entries when empty), saturating at zero. Expired counts restart
/// from zero. Returns `false` when the table is full of busy entries.
pub fn load_add(
    table: &mut Vec<u8>,
    capacity: u32,
    id: u64,
    requests: i32,
    prefill_tokens: i64,
    now_ms: u64,
    ttl_ms: u64,
) -> bool {
    let cap = capacity.max(1) as usize;
    if table.first() != Some(&LAYOUT_VERSION)
        || !(table.len() - 1).is_multiple_of(LOAD_ENTRY)
        || (table.len() - 1) / LOAD_ENTRY != cap
    {
        table.clear();
        table.push(LAYOUT_VERSION);
        table.resize(1 + cap * LOAD_ENTRY, 0);
    }
    let Some((at, found)) = load_find(table, id) else {
        return false;
    };
    let cur = if found {
        load_get(table, id, now_ms, ttl_ms)
    } else {
        Load::default()
    };
    let req = (cur.requests as i64 + requests as i64).clamp(0, u32::MAX as i64) as u32;
    let pre = (cur.prefill_tokens as i64 + prefill_tokens).clamp(0, u32::MAX as i64) as u32;
    let Some(e) = table.get_mut(at..at + LOAD_ENTRY) else {
        return false;
    };
    e[..8].copy_from_slice(&id.to_le_bytes());
    e[8..16].copy_from_slice(&((req as u64) | (pre as u64) << 32).to_le_bytes());
    e[16..24].copy_from_slice(&now_ms.to_le_bytes());
    true
}

/// [`load_add`] on the shared load key, with CAS retries.
///
/// # Errors
/// A host failure, or [`StoreError::CasMismatch`] after [`CAS_RETRIES`] lost races.
#[allow(clippy::too_many_arguments)]
pub fn load_update<S: Store>(
    store: &S,
    keys: &Keys,
    capacity: u32,
    id: u64,
    requests: i32,
    prefill_tokens: i64,
    now_ms: u64,
    ttl_ms: u64,
) -> Result<bool, StoreError> {
    let key = keys.load();
    for _ in 0..CAS_RETRIES {
        let (value, cas) = store.get(&key)?;
        let mut table = value.unwrap_or_default();
        if !load_add(
            &mut table,
            capacity,
            id,
            requests,
            prefill_tokens,
            now_ms,
            ttl_ms,
        ) {
            return Ok(false);
        }
        match store.set(&key, &table, cas) {
            Ok(()) => return Ok(true),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// A [`Store`] over an in-memory map with Envoy's semantics (CAS checked only on existing
/// keys, empty values kept): for tests and benchmarks.
#[derive(Debug, Default)]
pub struct MemStore {
    map: RefCell<hashbrown::HashMap<String, (Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    reads: Cell<u64>,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of keys ever written.
    pub fn key_count(&self) -> usize {
        self.map.borrow().len()
    }

    /// Total bytes of all values.
    pub fn value_bytes(&self) -> usize {
        self.map.borrow().values().map(|v| v.0.len()).sum()
    }

    /// Reads so far.
    pub fn reads(&self) -> u64 {
        self.reads.get()
    }

    pub fn keys(&self) -> Vec<String> {
        self.map.borrow().keys().cloned().collect()
    }
}

impl Store for MemStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        self.reads.set(self.reads.get() + 1);
        Ok(match self.map.borrow().get(key) {
            Some((v, cas)) => ((!v.is_empty()).then(|| v.clone()), *cas),
            None => (None, 0),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let mut map = self.map.borrow_mut();
        let next = self.next_cas.get().wrapping_add(1).max(1);
        self.next_cas.set(next);
        match map.get_mut(key) {
            Some(e) => {
                if cas != 0 && cas != e.1 {
                    return Err(StoreError::CasMismatch);
                }
                *e = (value.to_vec(), next);
            }
            None => {
                map.insert(key.to_owned(), (value.to_vec(), next));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lookup::{longest_matches, WalkStats};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn limits(bits: u8) -> Limits {
        Limits {
            buckets_log2: bits,
            max_workers: 64,
            max_bucket_keys: 4096,
            max_models: 16,
        }
    }

    fn worker(id: u32, inst: &str, dp: u32) -> Op {
        Op::Worker {
            id: WorkerId(id),
            live: true,
            dp_rank: dp,
            instance_id: inst.into(),
            address: format!("10.0.0.{id}:8000"),
            tenant: "default".into(),
            model: "m".into(),
        }
    }

    fn blocks(w: u32, tier: Tier, added: bool, keys: &[u64]) -> Op {
        Op::Blocks {
            worker: WorkerId(w),
            tier,
            added,
            keys: keys.iter().map(|&k| BlockKey(k)).collect(),
        }
    }

    fn page(flags: u8, epoch: u64, cursor: u64, ops: Vec<Op>) -> Page {
        Page {
            flags,
            epoch,
            cursor,
            ops,
        }
    }

    fn holders(store: &MemStore, keys: &Keys, l: &Limits, k: u64) -> Vec<(WorkerId, TierMask)> {
        let (state, _) = read_state(store, keys).unwrap();
        let view = BucketView::new(store, keys, &state, l.buckets_log2);
        let mut out = Vec::new();
        view.holders(BlockKey(k), &mut out);
        out
    }

    #[test]
    fn bucket_round_trips_and_finds_keys() {
        let mut rows = BucketRows::default();
        assert!(rows.add(5, 1, Tier::Gpu, 10));
        assert!(rows.add(5, 0, Tier::Cpu, 10));
        assert!(rows.add(3, 2, Tier::Disk, 10));
        assert!(rows.add(5, 1, Tier::Cpu, 10));
        let mut v = Vec::new();
        rows.encode(7, &mut v);
        assert!(
            BucketRef::parse(&v, 8).is_none(),
            "another build's bucket reads as empty"
        );
        let b = BucketRef::parse(&v, 7).unwrap();
        assert_eq!(b.len(), 2);
        let mut out = Vec::new();
        b.holders_into(BlockKey(5), &mut out);
        assert_eq!(
            out,
            vec![(WorkerId(0), TierMask(2)), (WorkerId(1), TierMask(3))]
        );
        out.clear();
        b.holders_into(BlockKey(4), &mut out);
        assert!(out.is_empty());
        assert_eq!(BucketRows::from_ref(Some(b)), rows);
        rows.remove(5, 1, Tier::Gpu);
        rows.remove(5, 1, Tier::Cpu);
        rows.remove(5, 0, Tier::Cpu);
        assert_eq!(rows.keys(), 1);
    }

    #[test]
    fn prefix_view_hashes_lazily_and_matches_the_eager_walk() {
        let store = MemStore::new();
        let keys = Keys::new("t");
        let l = limits(8);
        let tokens: Vec<u32> = (0..16 * 64).collect();
        let scope = crate::scope::ScopeId::of("default", "m", None, None);
        let seqs =
            crate::hash::sequence_hashes(&tokens, 16, crate::hash::seed(None, None)).unwrap();
        let bkeys: Vec<u64> = seqs.iter().map(|s| scope.key(*s).0).collect();
        let ops = vec![
            worker(0, "a", 0),
            worker(1, "b", 0),
            blocks(0, Tier::Gpu, true, &bkeys[..40]),
            blocks(1, Tier::Gpu, true, &bkeys[..7]),
        ];
        apply_page(&store, &keys, &l, &page(Page::RESET, 1, 1, ops), 0).unwrap();
        let (st, _) = read_state(&store, &keys).unwrap();
        let eager: Vec<BlockKey> = bkeys.iter().map(|&k| BlockKey(k)).collect();
        let want = longest_matches(
            &BucketView::new(&store, &keys, &st, l.buckets_log2),
            &eager,
            &mut WalkStats::default(),
        );
        let view = PrefixView::new(
            BucketView::new(&store, &keys, &st, l.buckets_log2),
            &tokens,
            16,
            crate::hash::seed(None, None),
            scope,
            Vec::new(),
        );
        let mut depths = Vec::new();
        depth_keys(view.blocks(), &mut depths);
        let got = longest_matches(&view, &depths, &mut WalkStats::default());
        assert_eq!(got, want);
        assert!(view.hashed() < 64, "hashed {} of 64 blocks", view.hashed());
        // Nobody holds the first block of another prompt: one block hashed.
        let other: Vec<u32> = (5000..5000 + 16 * 64).collect();
        let view = PrefixView::new(
            BucketView::new(&store, &keys, &st, l.buckets_log2),
            &other,
            16,
            crate::hash::seed(None, None),
            scope,
            Vec::new(),
        );
        assert!(longest_matches(&view, &depths, &mut WalkStats::default()).is_empty());
        assert_eq!(view.hashed(), 1);
        depth_keys(3, &mut depths);
        assert_eq!(depths, vec![BlockKey(0), BlockKey(1), BlockKey(2)]);
    }

    #[test]
    fn bucket_keys_are_hex() {
        let k = Keys::new("p");
        assert_eq!(k.bucket(0, 0), "kvroute/p/v2/g0/b0");
        assert_eq!(k.bucket(1, 0x3fff), "kvroute/p/v2/g1/b3fff");
        assert_eq!(k.bucket(2, 16), "kvroute/p/v2/g0/b10");
    }

    #[test]
    fn full_bucket_drops_new_keys_only() {
        let mut rows = BucketRows::default();
        assert!(rows.add(1, 0, Tier::Gpu, 2));
        assert!(rows.add(2, 0, Tier::Gpu, 2));
        assert!(!rows.add(3, 0, Tier::Gpu, 2));
        assert!(
            rows.add(2, 1, Tier::Gpu, 2),
            "a new holder of a kept key still fits"
        );
    }

    #[test]
    fn damaged_values_never_panic() {
        for len in 0..40 {
            let v: Vec<u8> = (0..len).map(|i| (i * 37 + 1) as u8).collect();
            let _ = BucketRef::parse(&v, 0);
            let _ = Meta::decode(&v, 0);
            let _ = SyncState::decode(&v);
            let _ = Lease::decode(&v);
            let _ = load_get(&v, 1, 0, 10);
        }
    }

    #[test]
    fn reset_builds_aside_and_switches_whole() {
        let store = MemStore::new();
        let keys = Keys::new("t");
        let l = limits(4);
        assert_eq!(
            apply_page(&store, &keys, &l, &page(0, 1, 1, vec![]), 0),
            Err(SyncError::NoBase)
        );
        let p1 = page(
            Page::RESET | Page::MORE,
            1,
            10,
            vec![worker(0, "a", 0), blocks(0, Tier::Gpu, true, &[1 << 60])],
        );
        let a = apply_page(&store, &keys, &l, &p1, 5).unwrap();
        assert!(!a.switched && a.more);
        assert!(
            read_state(&store, &keys).unwrap().0.is_stale(5, 1000),
            "nothing switched in yet"
        );
        assert!(holders(&store, &keys, &l, 1 << 60).is_empty());
        let a = apply_page(
            &store,
            &keys,
            &l,
            &page(0, 1, 11, vec![blocks(0, Tier::Gpu, true, &[2 << 60])]),
            6,
        )
        .unwrap();
        assert!(a.switched);
        let (st, _) = read_state(&store, &keys).unwrap();
        assert!(!st.is_stale(6, 1000));
        assert_eq!(st.feed_query(), "?epoch=1&since=11");
        assert_eq!(
            holders(&store, &keys, &l, 1 << 60),
            vec![(WorkerId(0), TierMask(1))]
        );
        // A new snapshot goes to the other generation; readers keep the old one meanwhile.
        apply_page(
            &store,
            &keys,
            &l,
            &page(Page::RESET | Page::MORE, 2, 1, vec![worker(0, "a", 0)]),
            7,
        )
        .unwrap();
        assert_eq!(
            holders(&store, &keys, &l, 1 << 60),
            vec![(WorkerId(0), TierMask(1))]
        );
        assert!(read_state(&store, &keys)
            .unwrap()
            .0
            .feed_query()
            .starts_with("?epoch=2&since=1"));
        apply_page(&store, &keys, &l, &page(0, 2, 2, vec![]), 8).unwrap();
        assert!(
            holders(&store, &keys, &l, 1 << 60).is_empty(),
            "the old build's blocks are gone"
        );
        // A delta of another epoch drops the cursor so the next pull asks for a snapshot.
        assert!(matches!(
            apply_page(&store, &keys, &l, &page(0, 9, 3, vec![]), 9),
            Err(SyncError::EpochMismatch { got: 9, want: 2 })
        ));
        assert_eq!(read_state(&store, &keys).unwrap().0.feed_query(), "");
    }

    #[test]
    fn meta_tracks_workers_sizes_and_aliases() {
        let store = MemStore::new();
        let keys = Keys::new("t");
        let l = limits(2);
        let ops = vec![
            worker(3, "inst", 1),
            worker(99, "too-far", 0),
            Op::BlockSize {
                tenant: "default".into(),
                model: "m".into(),
                block_size: 16,
            },
            Op::Alias {
                tenant: "default".into(),
                served: "ad".into(),
                model: "m".into(),
                lora: Some("ad".into()),
            },
        ];
        let a = apply_page(&store, &keys, &l, &page(Page::RESET, 1, 1, ops), 0).unwrap();
        assert_eq!(a.stats.bad_workers, 1);
        let (st, _) = read_state(&store, &keys).unwrap();
        let meta =
            Meta::decode(&store.get(&keys.meta(st.gen)).unwrap().0.unwrap(), st.stamp).unwrap();
        assert_eq!(meta.worker(3).unwrap().dp_rank, 1);
        assert_eq!(meta.block_size("default", "m"), Some(16));
        assert_eq!(meta.resolve("default", "ad"), ("m", Some("ad")));
        assert_eq!(meta.resolve("default", "m"), ("m", None));
        let v = st.meta_version;
        apply_page(
            &store,
            &keys,
            &l,
            &page(0, 1, 2, vec![Op::WorkerGone { id: WorkerId(3) }]),
            1,
        )
        .unwrap();
        let (st, _) = read_state(&store, &keys).unwrap();
        assert_ne!(st.meta_version, v);
        let meta =
            Meta::decode(&store.get(&keys.meta(st.gen)).unwrap().0.unwrap(), st.stamp).unwrap();
        assert!(meta.worker(3).is_none());
    }

    #[test]
    fn lease_is_exclusive_until_it_lapses() {
        let store = MemStore::new();
        let keys = Keys::new("t");
        assert!(acquire_lease(&store, &keys, 1, 0, 100).unwrap());
        assert!(!acquire_lease(&store, &keys, 2, 50, 100).unwrap());
        assert!(acquire_lease(&store, &keys, 1, 60, 100).unwrap());
        assert!(!acquire_lease(&store, &keys, 2, 150, 100).unwrap());
        assert!(acquire_lease(&store, &keys, 2, 161, 100).unwrap());
        assert_eq!(next_vm_id(&store, &keys), Ok(1));
        assert_eq!(next_vm_id(&store, &keys), Ok(2));
    }

    #[test]
    fn load_counts_saturate_and_expire() {
        let store = MemStore::new();
        let keys = Keys::new("t");
        load_update(&store, &keys, 8, 3, 1, 100, 0, 1000).unwrap();
        load_update(&store, &keys, 8, 3, 1, 50, 10, 1000).unwrap();
        load_update(&store, &keys, 8, 11, 1, 5, 10, 1000).unwrap();
        let t = store.get(&keys.load()).unwrap().0.unwrap();
        assert_eq!(
            load_get(&t, 3, 20, 1000),
            Load {
                requests: 2,
                prefill_tokens: 150
            }
        );
        assert_eq!(
            load_get(&t, 11, 20, 1000),
            Load {
                requests: 1,
                prefill_tokens: 5
            }
        );
        assert_eq!(load_get(&t, 3, 2000, 1000), Load::default(), "expired");
        load_update(&store, &keys, 8, 3, -5, -1000, 30, 1000).unwrap();
        let t = store.get(&keys.load()).unwrap().0.unwrap();
        assert_eq!(load_get(&t, 3, 30, 1000), Load::default());
        assert_eq!(t.len(), 1 + 8 * LOAD_ENTRY);
    }

    #[test]
    fn churning_a_million_blocks_keeps_the_keyspace_fixed() {
        let store = MemStore::new();
        let keys = Keys::new("t");
        let l = limits(10);
        apply_page(
            &store,
            &keys,
            &l,
            &page(
                Page::RESET,
                1,
                0,
                vec![worker(0, "a", 0), worker(1, "b", 0)],
            ),
            0,
        )
        .unwrap();
        let base = store.key_count();
        let mut cursor = 0;
        let mut seen_max = 0;
        for chunk in 0..20u64 {
            let ks: Vec<u64> = (0..50_000u64)
                .map(|i| (chunk * 50_000 + i).wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect();
            cursor += 1;
            apply_page(
                &store,
                &keys,
                &l,
                &page(
                    0,
                    1,
                    cursor,
                    vec![blocks((chunk % 2) as u32, Tier::Gpu, true, &ks)],
                ),
                cursor,
            )
            .unwrap();
            seen_max = seen_max.max(store.key_count());
            cursor += 1;
            apply_page(
                &store,
                &keys,
                &l,
                &page(
                    0,
                    1,
                    cursor,
                    vec![blocks((chunk % 2) as u32, Tier::Gpu, false, &ks)],
                ),
                cursor,
            )
            .unwrap();
        }
        let fixed = 4 + 2 * (1 + l.buckets() as usize);
        assert!(seen_max <= fixed, "{seen_max} keys > {fixed}");
        assert!(store.key_count() <= fixed);
        assert!(base <= store.key_count());
        // Everything removed: buckets are empty again.
        assert!(store.value_bytes() < fixed * 64);
    }

    /// Naive model: BTreeMap of (key, slot) → mask.
    #[derive(Debug, Clone)]
    enum TOp {
        Add(u8, u8, u8),
        Remove(u8, u8, u8),
        Gone(u8),
    }

    fn arb_op() -> impl Strategy<Value = TOp> {
        prop_oneof![
            (0u8..12, 0u8..4, 0u8..3).prop_map(|(k, w, t)| TOp::Add(k, w, t)),
            (0u8..12, 0u8..4, 0u8..3).prop_map(|(k, w, t)| TOp::Remove(k, w, t)),
            (0u8..4).prop_map(TOp::Gone),
        ]
    }

    proptest! {
        #[test]
        fn buckets_agree_with_a_naive_map(ops in proptest::collection::vec(arb_op(), 1..60)) {
            let store = MemStore::new();
            let keys = Keys::new("p");
            let l = limits(1);
            let workers: Vec<Op> = (0..4).map(|w| worker(w, "i", 0)).collect();
            apply_page(&store, &keys, &l, &page(Page::RESET, 1, 0, workers), 0).unwrap();
            let mut model: BTreeMap<(u64, u16), u8> = BTreeMap::new();
            // Keys spread over both buckets, small key space so collisions happen.
            let key = |k: u8| (k as u64) << 60 | k as u64;
            for (n, op) in ops.iter().enumerate() {
                let p = match op {
                    TOp::Add(k, w, t) => {
                        *model.entry((key(*k), *w as u16)).or_default() |= 1 << t;
                        blocks(*w as u32, Tier::from_u8(*t).unwrap(), true, &[key(*k)])
                    }
                    TOp::Remove(k, w, t) => {
                        if let Some(m) = model.get_mut(&(key(*k), *w as u16)) {
                            *m &= !(1 << t);
                            if *m == 0 { model.remove(&(key(*k), *w as u16)); }
                        }
                        blocks(*w as u32, Tier::from_u8(*t).unwrap(), false, &[key(*k)])
                    }
                    TOp::Gone(w) => {
                        // The feed sends removals before WorkerGone: mimic it.
                        let held: Vec<(u64, u8)> = model.iter().filter(|((_, s), _)| *s == *w as u16).map(|((k, _), m)| (*k, *m)).collect();
                        let mut ops = Vec::new();
                        for (k, m) in held {
                            for t in 0..3u8 {
                                if m & (1 << t) != 0 { ops.push(blocks(*w as u32, Tier::from_u8(t).unwrap(), false, &[k])); }
                            }
                            model.remove(&(k, *w as u16));
                        }
                        ops.push(Op::WorkerGone { id: WorkerId(*w as u32) });
                        ops.push(worker(*w as u32, "i", 0));
                        apply_page(&store, &keys, &l, &page(0, 1, n as u64 + 1, ops), 0).unwrap();
                        continue;
                    }
                };
                apply_page(&store, &keys, &l, &page(0, 1, n as u64 + 1, vec![p]), 0).unwrap();
                for k in 0..12u8 {
                    let got = holders(&store, &keys, &l, key(k));
                    let want: Vec<(WorkerId, TierMask)> = model.range((key(k), 0)..=(key(k), u16::MAX)).map(|((_, s), m)| (WorkerId(*s as u32), TierMask(*m))).collect();
                    prop_assert_eq!(got, want);
                }
            }
        }
    }

    #[test]
    fn view_walk_reads_grow_with_log_depth() {
        let store = MemStore::new();
        let keys = Keys::new("t");
        let l = limits(12);
        let chain: Vec<u64> = (1..=4096u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let ops = vec![
            worker(0, "a", 0),
            worker(1, "b", 0),
            blocks(0, Tier::Gpu, true, &chain),
            blocks(1, Tier::Cpu, true, &chain[..1000]),
        ];
        apply_page(&store, &keys, &l, &page(Page::RESET, 1, 1, ops), 0).unwrap();
        let (st, _) = read_state(&store, &keys).unwrap();
        let view = BucketView::new(&store, &keys, &st, l.buckets_log2);
        let q: Vec<BlockKey> = chain.iter().map(|&k| BlockKey(k)).collect();
        let mut stats = WalkStats::default();
        let m = longest_matches(&view, &q, &mut stats);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].blocks, [4096, 4096, 4096]);
        assert_eq!(m[1].blocks, [0, 1000, 1000]);
        assert!(view.reads() <= 40, "{} reads", view.reads());
    }
}
