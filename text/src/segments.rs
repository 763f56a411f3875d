//! Tokenizing a text piece by piece between added tokens, with a cache of the pieces.
//!
//! `tokenizers` first cuts the text at its added tokens (`<|im_start|>`, `<think>`, ...) and
//! then normalizes, pre-tokenizes and BPE-encodes each piece on its own, so a piece's ids never
//! depend on its neighbours. A chat is such pieces, one or more per turn: the next request of a
//! conversation repeats every earlier turn (and every user shares the system prompt), so with
//! the pieces cached only the new turn is tokenized. Used only where it is exact: every added
//! token matched verbatim (not normalized, no strip or single-word rule) and a post-processor
//! that adds nothing; otherwise [`Segmenter::build`] says no and the whole text goes to
//! `tokenizers` as before.

use hashbrown::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

/// Pieces shorter than this are tokenized every time: cheap, and not worth a cache slot.
const MIN_CACHED_BYTES: usize = 32;

pub(crate) struct Segmenter {
    matcher: AhoCorasick,
    /// The id of each pattern of `matcher`.
    ids: Vec<u32>,
    cache: Mutex<Cache>,
}

/// Two generations: a full young one becomes the old one (the previous old is dropped), so
/// memory stays under the budget and pieces in use survive by being promoted.
#[derive(Default)]
struct Cache {
    young: HashMap<Box<str>, Arc<[u32]>>,
    old: HashMap<Box<str>, Arc<[u32]>>,
    young_bytes: usize,
    budget_bytes: usize,
}

impl Cache {
    fn get(&mut self, piece: &str) -> Option<Arc<[u32]>> {
        if let Some(ids) = self.young.get(piece) {
            return Some(ids.clone());
        }
        let ids = self.old.remove(piece)?;
        self.put(piece, ids.clone());
        Some(ids)
    }

    fn put(&mut self, piece: &str, ids: Arc<[u32]>) {
        let bytes = piece.len() + ids.len() * 4 + 64;
        if self.young_bytes + bytes > self.budget_bytes / 2 {
            self.old = std::mem::take(&mut self.young);
            self.young_bytes = 0;
        }
        self.young_bytes += bytes;
        self.young.insert(piece.into(), ids);
    }
}

impl Segmenter {
    /// A segmenter for `inner`, or `None` when piecewise encoding would not be exact.
    pub(crate) fn build(inner: &tokenizers::Tokenizer, budget_bytes: usize) -> Option<Segmenter> {
        let added = inner.get_added_tokens_decoder();
        if added.is_empty()
            || added.values().any(|t| {
                t.normalized || t.lstrip || t.rstrip || t.single_word || t.content.is_empty()
            })
        {
            return None;
        }
        // The post-processor must add nothing (no BOS/EOS): pieces are encoded without it.
        for probe in ["", "a b", "\n"] {
            let with = inner.encode_fast(probe, true).ok()?;
            let without = inner.encode_fast(probe, false).ok()?;
            if with.get_ids() != without.get_ids() {
                return None;
            }
        }
        let mut tokens: Vec<(u32, String)> = added
            .iter()
            .map(|(id, t)| (*id, t.content.clone()))
            .collect();
        tokens.sort();
        let matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(_, c)| c.as_str()))
            .ok()?;
        Some(Segmenter {
            matcher,
            ids: tokens.into_iter().map(|(id, _)| id).collect(),
            cache: Mutex::new(Cache {
                budget_bytes,
                ..Cache::default()
            }),
        })
    }

    /// The ids of `text`, piece by piece; `encode_piece` encodes text free of added tokens.
    pub(crate) fn encode(
        &self,
        text: &str,
        encode_piece: &dyn Fn(&str) -> tokenizers::Result<Vec<u32>>,
    ) -> tokenizers::Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        for m in self.matcher.find_iter(text) {
            self.piece(encode_piece, &text[at..m.start()], &mut out)?;
            if let Some(id) = self.ids.get(m.pattern().as_usize()) {
                out.push(*id);
            }
            at = m.end();
        }
        self.piece(encode_piece, &text[at..], &mut out)?;
        Ok(out)
    }

    fn piece(
        &self,
        encode_piece: &dyn Fn(&str) -> tokenizers::Result<Vec<u32>>,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        if piece.is_empty() {
            return Ok(());
        }
        if piece.len() < MIN_CACHED_BYTES {
            out.extend_from_slice(&encode_piece(piece)?);
            return Ok(());
        }
        let cached = self.lock().get(piece);
        let ids = match cached {
            Some(ids) => ids,
            None => {
                // Tokenized outside the lock: other threads go on meanwhile.
                let ids: Arc<[u32]> = encode_piece(piece)?.into();
                self.lock().put(piece, ids.clone());
                ids
            }
        };
        out.extend_from_slice(&ids);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}
