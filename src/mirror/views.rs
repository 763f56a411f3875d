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
