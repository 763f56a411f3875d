//! The request path's views of the active generation: holders of a block key read from the
//! buckets ([`BucketView`]), and a prompt walked by depth, hashed lazily ([`PrefixView`]).

use core::cell::{Cell, RefCell};

use crate::event::WorkerId;
use crate::hash::{SeqHash, SeqHashes};
use crate::lookup::{HolderView, TierMask};
use crate::scope::{BlockKey, ScopeId};

use super::buckets::BucketRef;
use super::keys::{bucket_of, Keys};
use super::store::Store;
use super::sync::SyncState;

/// Bucket values one VM has read, kept while the active index is unchanged: a request that
/// probes a bucket an earlier request of the same VM read (the same prompt, a shared prefix,
/// another block that falls in it) costs no shared-data read, until the lease holder applies
/// the next page.
///
/// The entries are valid for one sync state, its sync time aside ([`BucketCache::sync`]):
/// the lease holder writes a page's buckets before the state that moves the cursor, so a
/// state a reader sees unchanged has no newer bucket writes behind it (a page cut short by a
/// host failure is written again, with the cursor move, at the next pull). Bounded: when
/// [`BucketCache::MAX_ENTRIES`] buckets are held, the next one empties it.
#[derive(Debug, Default)]
pub struct BucketCache {
    /// The sync state the entries were read under, with `synced_at_ms` zeroed.
    state: Option<SyncState>,
    /// Bucket index → its value (`None`: the key holds nothing).
    entries: hashbrown::HashMap<u32, Option<Vec<u8>>>,
}

impl BucketCache {
    /// Most bucket values held (about 1 KB each with the default limits).
    pub const MAX_ENTRIES: usize = 512;

    /// Keeps the entries if `state` is the one they were read under, else drops them.
    pub fn sync(&mut self, state: &SyncState) {
        let tag = SyncState {
            synced_at_ms: 0,
            ..*state
        };
        if self.state != Some(tag) {
            self.entries.clear();
            self.state = Some(tag);
        }
    }

    /// Bucket values held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no bucket value is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

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
    /// Reads answered from `cache` (counted in `reads` too).
    cached: Cell<u32>,
    cache: Option<RefCell<&'a mut BucketCache>>,
}

impl<'a, S: Store> BucketView<'a, S> {
    /// A view of the generation `state` names.
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
            cached: Cell::new(0),
            cache: None,
        }
    }

    /// The same view, reading through `cache` (synced to `state` here): a bucket already in
    /// it is not read from the store again.
    pub fn with_cache(
        store: &'a S,
        keys: &'a Keys,
        state: &SyncState,
        buckets_log2: u8,
        cache: &'a mut BucketCache,
    ) -> Self {
        cache.sync(state);
        BucketView {
            cache: Some(RefCell::new(cache)),
            ..BucketView::new(store, keys, state, buckets_log2)
        }
    }

    /// Reads answered from the cache (each also counted in [`BucketView::reads`]).
    pub fn cached(&self) -> u32 {
        self.cached.get()
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
        let idx = bucket_of(key, self.buckets_log2);
        self.reads.set(self.reads.get() + 1);
        let mut cache = self.cache.as_ref().and_then(|c| c.try_borrow_mut().ok());
        if let Some(value) = cache.as_ref().and_then(|c| c.entries.get(&idx)) {
            self.cached.set(self.cached.get() + 1);
            if let Some(b) = value
                .as_deref()
                .and_then(|v| BucketRef::parse(v, self.stamp))
            {
                b.holders_into(key, out);
            }
            return;
        }
        let Ok(mut buf) = self.key_buf.try_borrow_mut() else {
            return;
        };
        self.keys.bucket_into(self.gen, idx, &mut buf);
        let value = match self.store.get(&buf) {
            Ok((v, _)) => v,
            Err(_) => {
                self.errors.set(self.errors.get() + 1);
                return;
            }
        };
        if let Some(b) = value
            .as_deref()
            .and_then(|v| BucketRef::parse(v, self.stamp))
        {
            b.holders_into(key, out);
        }
        if let Some(c) = cache.as_mut() {
            if c.entries.len() >= BucketCache::MAX_ENTRIES {
                c.entries.clear();
            }
            c.entries.insert(idx, value);
        }
    }
}

/// The position of a block in one prompt (0 = the first full block): what a [`PrefixView`]
/// walk is given in place of block keys, since the keys of the deeper blocks are computed
/// only if the walk gets there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Depth(pub u32);

/// A [`HolderView`] over a prompt that hashes lazily: the walk is given the [`Depth`]s
/// `0, 1, ...` (see [`depth_keys`]) and this view computes sequence hashes only up to the
/// deepest depth it is asked about, and a block key only for the depths it reads. A prompt
/// whose first block nobody holds costs one block hash; a full match costs the chain of
/// block hashes but only `reads` key hashes instead of one per block.
#[derive(Debug)]
pub struct PrefixView<'a, S: Store> {
    inner: BucketView<'a, S>,
    blocks: usize,
    scope: ScopeId,
    /// The chain so far, and the iterator that extends it.
    seqs: RefCell<(Vec<SeqHash>, SeqHashes<'a>)>,
}

impl<'a, S: Store> PrefixView<'a, S> {
    /// `seqs` is a reusable buffer (cleared here); get it back with [`PrefixView::into_seqs`].
    /// A `block_size` of 0 is taken as 1.
    pub fn new(
        inner: BucketView<'a, S>,
        tokens: &'a [u32],
        block_size: usize,
        seed: u64,
        scope: ScopeId,
        mut seqs: Vec<SeqHash>,
    ) -> Self {
        seqs.clear();
        let block_size = block_size.max(1);
        let chain = crate::hash::chained(crate::hash::BlockHashes::new(tokens, block_size, seed));
        PrefixView {
            inner,
            blocks: tokens.len() / block_size,
            scope,
            seqs: RefCell::new((seqs, chain)),
        }
    }

    /// Full blocks of the prompt: the length of the depth list to walk.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Blocks hashed so far.
    pub fn hashed(&self) -> usize {
        self.seqs.borrow().0.len()
    }

    /// Shared-data reads so far.
    pub fn reads(&self) -> u32 {
        self.inner.reads()
    }

    /// Of [`PrefixView::reads`], those answered from the VM's bucket cache.
    pub fn cached(&self) -> u32 {
        self.inner.cached()
    }

    /// The sequence-hash buffer, for reuse by the next request.
    pub fn into_seqs(self) -> Vec<SeqHash> {
        self.seqs.into_inner().0
    }

    /// The block key of the prompt's first `depth + 1` blocks (what the speculative table
    /// stores), extending the chain as needed.
    pub fn key_at(&self, depth: Depth) -> Option<crate::scope::BlockKey> {
        self.seq_at(depth).map(|s| self.scope.key(s))
    }

    /// The sequence hash at `depth`, extending the chain as needed.
    fn seq_at(&self, depth: Depth) -> Option<SeqHash> {
        let mut guard = self.seqs.try_borrow_mut().ok()?;
        let (seqs, chain) = &mut *guard;
        let depth = depth.0 as usize;
        while seqs.len() <= depth {
            seqs.push(chain.next()?);
        }
        seqs.get(depth).copied()
    }
}

impl<S: Store> HolderView<Depth> for PrefixView<'_, S> {
    fn holders(&self, depth: Depth, out: &mut Vec<(WorkerId, TierMask)>) {
        if let Some(seq) = self.seq_at(depth) {
            self.inner.holders(self.scope.key(seq), out);
        }
    }
}

/// Fills `out` with the depths `0 .. n`: the "keys" a [`PrefixView`] walk is given.
pub fn depth_keys(n: usize, out: &mut Vec<Depth>) {
    // Earlier fills wrote the same values: only the missing tail is written.
    out.truncate(n);
    for i in out.len()..n {
        out.push(Depth(i as u32));
    }
}
