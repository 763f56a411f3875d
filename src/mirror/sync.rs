//! The sync state and the lease: which VM pulls the feed, which generation readers use, and
//! how one feed page is applied to shared data ([`apply_page`]).

use crate::codec::{le_u64, Reader};
use crate::event::Tier;
use crate::feed::{Op, Page, StreamMark};
use crate::scope::BlockKey;

use super::buckets::{BucketRef, BucketRows};
use super::keys::{bucket_of, Keys, Limits, LAYOUT_VERSION};
use super::meta::{ApplyStats, Meta};
use super::store::{update_value, Store, StoreError};

/// A full resync in progress, built into the inactive generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Build {
    /// The generation being built (0 or 1).
    pub gen: u8,
    /// The stamp its values carry.
    pub stamp: u32,
    /// The feed epoch it follows.
    pub epoch: u64,
    /// The feed cursor it has reached.
    pub cursor: u64,
    /// The stream position that cursor completes (stream 0: none known).
    pub mark: StreamMark,
}

/// What `{prefix}/active` holds.
///
/// # Layout
///
/// ```text
/// version u8, flags u8 (bit 0 has_index, bit 1 building, bit 2 cursor valid)
/// gen u8, stamp u32, meta_version u32, next_stamp u32, epoch u64, cursor u64, synced_at_ms u64,
/// stream u64, seq u64
/// build: gen u8, stamp u32, epoch u64, cursor u64, stream u64, seq u64
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncState {
    /// An index has been switched in at least once.
    pub has_index: bool,
    /// The generation readers use.
    pub gen: u8,
    /// The stamp the active generation's values carry.
    pub stamp: u32,
    /// Bumped whenever the active generation's [`Meta`] changes, so readers re-read it.
    pub meta_version: u32,
    /// The next build stamp to hand out (stamps never repeat).
    pub next_stamp: u32,
    /// Feed epoch and cursor of the active generation; `cursor_valid == false` asks for a
    /// full snapshot.
    pub epoch: u64,
    /// See `epoch`.
    pub cursor: u64,
    /// See `epoch`.
    pub cursor_valid: bool,
    /// When the active generation last caught up with the collector (host clock, ms).
    pub synced_at_ms: u64,
    /// The stream position `cursor` completes (stream 0: none known): what another replica
    /// of the same stream can take over from (see `feed`'s "Handover").
    pub mark: StreamMark,
    /// A full resync in progress, if any.
    pub build: Option<Build>,
}

impl SyncState {
    /// Parses the state value; another layout or a damaged one is `None`.
    pub fn decode(b: &[u8]) -> Option<SyncState> {
        let mut r = Reader::new(b);
        if r.u8().ok()? != LAYOUT_VERSION {
            return None;
        }
        let flags = r.u8().ok()?;
        let mut s = SyncState {
            has_index: flags & 1 != 0,
            cursor_valid: flags & 4 != 0,
            gen: r.u8().ok()? & 1,
            stamp: r.u32().ok()?,
            meta_version: r.u32().ok()?,
            next_stamp: r.u32().ok()?,
            epoch: r.u64().ok()?,
            cursor: r.u64().ok()?,
            synced_at_ms: r.u64().ok()?,
            mark: StreamMark {
                stream: r.u64().ok()?,
                seq: r.u64().ok()?,
            },
            build: None,
        };
        let build = Build {
            gen: r.u8().ok()? & 1,
            stamp: r.u32().ok()?,
            epoch: r.u64().ok()?,
            cursor: r.u64().ok()?,
            mark: StreamMark {
                stream: r.u64().ok()?,
                seq: r.u64().ok()?,
            },
        };
        if flags & 2 != 0 {
            s.build = Some(build);
        }
        Some(s)
    }

    /// The state value.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(96);
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
        out.extend_from_slice(&self.mark.stream.to_le_bytes());
        out.extend_from_slice(&self.mark.seq.to_le_bytes());
        let b = self.build.unwrap_or_default();
        out.push(b.gen);
        out.extend_from_slice(&b.stamp.to_le_bytes());
        out.extend_from_slice(&b.epoch.to_le_bytes());
        out.extend_from_slice(&b.cursor.to_le_bytes());
        out.extend_from_slice(&b.mark.stream.to_le_bytes());
        out.extend_from_slice(&b.mark.seq.to_le_bytes());
        out
    }

    /// The query string of the next `/v1/feed` pull: `?v=4` (this reader takes version-4
    /// pages), then `&epoch=E&since=C` to continue, and `&stream=X&seq=S` when the position
    /// is also known in stream terms (another replica of the stream can then take it over);
    /// no cursor asks for a full snapshot.
    pub fn feed_query(&self) -> String {
        let (epoch, cursor, mark) = match self.build {
            Some(b) => (b.epoch, b.cursor, b.mark),
            None if self.has_index && self.cursor_valid => (self.epoch, self.cursor, self.mark),
            None => return format!("?v={}", crate::feed::VERSION),
        };
        let mut q = format!("?v={}&epoch={epoch}&since={cursor}", crate::feed::VERSION);
        // A build's marks are the snapshot's: nothing to hand over until it is switched in.
        if mark.stream != 0 && self.build.is_none() {
            q.push_str(&format!("&stream={}&seq={}", mark.stream, mark.seq));
        }
        q
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
    /// The VM id holding it.
    pub holder: u64,
    /// When it lapses (host clock, ms).
    pub expires_ms: u64,
}

impl Lease {
    /// Parses a lease value; another layout or a damaged one is `None`.
    pub fn decode(b: &[u8]) -> Option<Lease> {
        let mut r = Reader::new(b);
        if r.u8().ok()? != LAYOUT_VERSION {
            return None;
        }
        Some(Lease {
            holder: r.u64().ok()?,
            expires_ms: r.u64().ok()?,
        })
    }

    /// The lease value.
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
    let (value, cas) = store.get(key)?;
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
    match store.set(key, &lease.encode(), cas) {
        Ok(()) => Ok(true),
        Err(StoreError::CasMismatch) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Hands out a unique VM id from the shared counter.
///
/// # Errors
/// A host failure, or [`StoreError::CasMismatch`] after [`CAS_RETRIES`](super::CAS_RETRIES) lost races.
pub fn next_vm_id<S: Store>(store: &S, keys: &Keys) -> Result<u64, StoreError> {
    let mut n = 0;
    update_value(store, keys.vm_seq(), None, |v| {
        n = le_u64(v, 0) + 1;
        *v = n.to_le_bytes().to_vec();
        true
    })?;
    Ok(n)
}

/// Reads the sync state (default when missing or unreadable) and its CAS token.
///
/// # Errors
/// A host failure.
pub fn read_state<S: Store>(store: &S, keys: &Keys) -> Result<(SyncState, u32), StoreError> {
    let (value, cas) = store.get(keys.active())?;
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
    EpochMismatch {
        /// The page's epoch.
        got: u64,
        /// The epoch followed.
        want: u64,
    },
    /// A delta page before any snapshot.
    #[error("delta page with no index to apply it to")]
    NoBase,
    /// A handover this reader cannot take (its worker table differs from the new replica's,
    /// or it follows no index of that stream): the cursor is dropped, a snapshot follows.
    #[error("handover refused: {0}")]
    HandoverRefused(&'static str),
    /// Shared data failed.
    #[error("shared data: {0}")]
    Store(#[from] StoreError),
}

/// What applying a page did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Counts of what the page did.
    pub stats: ApplyStats,
    /// A full resync was switched in by this page.
    pub switched: bool,
    /// The page asked for another pull at once.
    pub more: bool,
    /// Another replica of the stream took over the cursor (no snapshot needed).
    pub handover: bool,
}

/// Applies one feed page to shared data: the lease holder's whole job.
///
/// A `RESET` page starts a new build in the inactive generation; pages of a build go there
/// until one without `MORE` switches it in. Delta pages go to the active generation. The
/// steps: pick the target generation (`target`), apply the meta ops (`apply_meta`) and
/// the block ops (`apply_blocks`), then move the cursor and maybe switch (`advance`).
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
    if page.is_handover() {
        return take_handover(store, keys, limits, page, now_ms, state, cas);
    }
    let target = match target(&mut state, page) {
        Ok(t) => t,
        Err(e) => {
            if matches!(e, SyncError::EpochMismatch { .. }) {
                write_state(store, keys, &state, cas)?;
            }
            return Err(e);
        }
    };
    let meta_changed = apply_meta(store, keys, limits, page, target, &mut out.stats)?;
    apply_blocks(store, keys, limits, page, target, &mut out.stats)?;
    // The feed removes a worker's blocks before its WorkerGone: no sweep of the buckets here.
    out.switched = advance(&mut state, page, meta_changed, now_ms);
    write_state(store, keys, &state, cas)?;
    Ok(out)
}

/// Where a page's ops go: a generation and the build stamp its values carry.
#[derive(Clone, Copy, Debug)]
struct Target {
    gen: u8,
    stamp: u32,
}

/// Step 1: the generation `page` writes to. A `RESET` starts a build (recorded in `state`);
/// a delta of another epoch drops the cursor in `state` (the caller writes it back) so the
/// next pull asks for a snapshot.
fn target(state: &mut SyncState, page: &Page) -> Result<Target, SyncError> {
    if page.is_reset() {
        let gen = if state.has_index { state.gen ^ 1 } else { 0 };
        let stamp = state.next_stamp.max(state.stamp).wrapping_add(1).max(1);
        state.next_stamp = stamp;
        state.build = Some(Build {
            gen,
            stamp,
            epoch: page.epoch,
            cursor: page.cursor,
            mark: page.stream_mark().unwrap_or_default(),
        });
        Ok(Target { gen, stamp })
    } else if let Some(b) = state.build {
        if b.epoch != page.epoch {
            state.build = None;
            state.cursor_valid = false;
            return Err(SyncError::EpochMismatch {
                got: page.epoch,
                want: b.epoch,
            });
        }
        Ok(Target {
            gen: b.gen,
            stamp: b.stamp,
        })
    } else if state.has_index && state.cursor_valid {
        if state.epoch != page.epoch {
            state.cursor_valid = false;
            return Err(SyncError::EpochMismatch {
                got: page.epoch,
                want: state.epoch,
            });
        }
        Ok(Target {
            gen: state.gen,
            stamp: state.stamp,
        })
    } else {
        Err(SyncError::NoBase)
    }
}

/// Step 2: the page's worker, block-size and alias ops, into the target's meta (a fresh
/// one for a `RESET`). Returns whether the meta changed (it is then written).
fn apply_meta<S: Store>(
    store: &S,
    keys: &Keys,
    limits: &Limits,
    page: &Page,
    t: Target,
    stats: &mut ApplyStats,
) -> Result<bool, StoreError> {
    let meta_key = keys.meta(t.gen);
    let mut meta = if page.is_reset() {
        Meta::default()
    } else {
        store
            .get(meta_key)?
            .0
            .as_deref()
            .and_then(|b| Meta::decode(b, t.stamp))
            .unwrap_or_default()
    };
    let mut changed = page.is_reset();
    for op in &page.ops {
        changed |= meta.apply(op, limits, stats);
    }
    if changed {
        store.set(meta_key, &meta.encode(t.stamp), 0)?;
    }
    Ok(changed)
}

/// One block hold added or removed, tagged with its bucket.
#[derive(Clone, Copy, Debug)]
struct BlockOp {
    bucket: u32,
    key: BlockKey,
    slot: u16,
    tier: Tier,
    added: bool,
}

/// Step 3: the page's block ops, grouped by bucket (a stable sort keeps each bucket's ops
/// in page order) so each touched bucket is read and written once.
fn apply_blocks<S: Store>(
    store: &S,
    keys: &Keys,
    limits: &Limits,
    page: &Page,
    t: Target,
    stats: &mut ApplyStats,
) -> Result<(), StoreError> {
    let mut ops: Vec<BlockOp> = Vec::new();
    for op in &page.ops {
        if let Op::Blocks {
            worker,
            tier,
            added,
            keys: bkeys,
        } = op
        {
            if worker.0 >= limits.max_workers {
                stats.bad_workers += 1;
                continue;
            }
            ops.extend(bkeys.iter().map(|&key| BlockOp {
                bucket: bucket_of(key, limits.buckets_log2),
                key,
                slot: worker.0 as u16,
                tier: *tier,
                added: *added,
            }));
        }
    }
    ops.sort_by_key(|o| o.bucket);
    let mut key_buf = String::new();
    let mut val_buf = Vec::new();
    for group in ops.chunk_by(|a, b| a.bucket == b.bucket) {
        let Some(first) = group.first() else { continue };
        keys.bucket_into(t.gen, first.bucket, &mut key_buf);
        let current = store.get(&key_buf)?.0;
        let mut rows = BucketRows::from_ref(
            current
                .as_deref()
                .and_then(|v| BucketRef::parse(v, t.stamp)),
        );
        for op in group {
            if op.added {
                if !rows.add(op.key, op.slot, op.tier, limits.max_bucket_keys) {
                    stats.bucket_full += 1;
                }
            } else {
                rows.remove(op.key, op.slot, op.tier);
            }
            stats.blocks += 1;
        }
        rows.encode(t.stamp, &mut val_buf);
        store.set(&key_buf, &val_buf, 0)?;
        stats.bucket_writes += 1;
    }
    Ok(())
}

/// Step 4: the cursor moves to the page's; a build the page completes is switched in whole.
/// Returns whether it was.
fn advance(state: &mut SyncState, page: &Page, meta_changed: bool, now_ms: u64) -> bool {
    // A page without a mark (an older collector, or one not on a stream, or a page inside a
    // snapshot) leaves the position unknown in stream terms.
    let mark = page.stream_mark().unwrap_or_default();
    match state.build {
        Some(mut b) => {
            b.cursor = page.cursor;
            b.epoch = page.epoch;
            b.mark = mark;
            if page.has_more() {
                state.build = Some(b);
                false
            } else {
                // Caught up: switch the build in whole.
                state.has_index = true;
                state.gen = b.gen;
                state.stamp = b.stamp;
                state.epoch = b.epoch;
                state.cursor = b.cursor;
                state.mark = b.mark;
                state.cursor_valid = true;
                state.meta_version = state.meta_version.wrapping_add(1);
                state.synced_at_ms = now_ms;
                state.build = None;
                true
            }
        }
        None => {
            state.cursor = page.cursor;
            state.mark = mark;
            if meta_changed {
                state.meta_version = state.meta_version.wrapping_add(1);
            }
            if !page.has_more() {
                state.synced_at_ms = now_ms;
            }
            false
        }
    }
}

/// A [`Page::HANDOVER`]: another replica of the stream this reader follows offers to go on
/// from the reader's stream position. Taken when the reader follows an index of that stream
/// at that position (no build under way) and the replica's worker table names the same
/// worker in every slot the reader's does; its table then updates the reader's (liveness,
/// block sizes, aliases) and its epoch and cursor become the reader's. Anything else drops
/// the cursor, so the next pull asks for a snapshot.
fn take_handover<S: Store>(
    store: &S,
    keys: &Keys,
    limits: &Limits,
    page: &Page,
    now_ms: u64,
    mut state: SyncState,
    cas: u32,
) -> Result<Applied, SyncError> {
    let refuse = |state: &mut SyncState, why: &'static str| {
        state.cursor_valid = false;
        state.build = None;
        write_state(store, keys, state, cas)?;
        Err(SyncError::HandoverRefused(why))
    };
    let mark = page.stream_mark().unwrap_or_default();
    if !state.has_index || !state.cursor_valid || state.build.is_some() {
        return refuse(&mut state, "no index of that stream followed");
    }
    if mark.stream == 0 || mark != state.mark {
        return refuse(&mut state, "another stream position");
    }
    let meta_key = keys.meta(state.gen);
    let mut meta = store
        .get(meta_key)?
        .0
        .as_deref()
        .and_then(|b| Meta::decode(b, state.stamp))
        .unwrap_or_default();
    if !same_workers(&meta, page, limits) {
        return refuse(&mut state, "another worker table");
    }
    let mut out = Applied {
        more: page.has_more(),
        handover: true,
        ..Applied::default()
    };
    let mut changed = false;
    for op in &page.ops {
        changed |= meta.apply(op, limits, &mut out.stats);
    }
    if changed {
        store.set(meta_key, &meta.encode(state.stamp), 0)?;
        state.meta_version = state.meta_version.wrapping_add(1);
    }
    state.epoch = page.epoch;
    state.cursor = page.cursor;
    state.mark = mark;
    state.synced_at_ms = now_ms;
    write_state(store, keys, &state, cas)?;
    Ok(out)
}

/// Whether the handover page's worker table occupies exactly the slots `meta` does, each
/// with the same worker (instance, data-parallel rank, address, tenant, model; liveness may
/// differ: the page's is newer).
fn same_workers(meta: &Meta, page: &Page, limits: &Limits) -> bool {
    let mut theirs: Vec<Option<&Op>> = Vec::new();
    for op in &page.ops {
        if let Op::Worker { id, .. } = op {
            let slot = id.0 as usize;
            if id.0 >= limits.max_workers {
                return false;
            }
            if theirs.len() <= slot {
                theirs.resize(slot + 1, None);
            }
            theirs[slot] = Some(op);
        }
    }
    let slots = theirs.len().max(meta.workers.len());
    (0..slots).all(|i| {
        let ours = meta.workers.get(i).and_then(Option::as_ref);
        match (ours, theirs.get(i).copied().flatten()) {
            (None, None) => true,
            (
                Some(w),
                Some(Op::Worker {
                    dp_rank,
                    instance_id,
                    address,
                    tenant,
                    model,
                    ..
                }),
            ) => {
                w.dp_rank == *dp_rank
                    && w.instance_id == *instance_id
                    && w.address == *address
                    && w.tenant == *tenant
                    && w.model == *model
            }
            _ => false,
        }
    })
}

/// Writes the sync state back, if nobody changed it since it was read.
fn write_state<S: Store>(
    store: &S,
    keys: &Keys,
    state: &SyncState,
    cas: u32,
) -> Result<(), StoreError> {
    store.set(keys.active(), &state.encode(), cas)
}
