//! The books of routed requests: one request's load booked on the decided worker (or
//! instance), released in two steps — its prefill at the first response bytes (which also
//! measures the engine's prefill rate when it found the engine idle), the rest at the end;
//! one step when the response arrives whole.

use super::picture::Picture;
use crate::mirror::{self, Keys, LoadDelta, LoadId, RateNote, Store, StoreError};

/// Where and how the books are kept.
#[derive(Clone, Copy, Debug)]
pub struct Books<'a, S> {
    /// The shared data.
    pub store: &'a S,
    /// Its keys.
    pub keys: &'a Keys,
    /// Most entries of the load table.
    pub capacity: u32,
    /// Time-to-live of an entry, milliseconds.
    pub ttl_ms: u64,
    /// A configured prefill rate (tokens per second); `None`: learned.
    pub prefill_rate: Option<u32>,
}

/// Why a booking or a release was not written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BookError {
    /// The load table is full of busy entries.
    #[error("load table full")]
    Full,
    /// The shared data refused the write.
    #[error("load table: {0}")]
    Store(#[from] StoreError),
}

/// Load booked for a routed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Booked {
    /// The entry it is booked on.
    pub id: LoadId,
    /// Uncached prompt tokens.
    pub prefill: u32,
    /// Decode budget, tokens.
    pub decode: u32,
    /// The prefill tokens are still booked (no response bytes yet).
    pub prefill_open: bool,
    /// When it was booked (host milliseconds).
    pub at_ms: u64,
    /// Its time to first bytes measures the engine's prefill rate: the engine had no prefill
    /// ahead of it by the books when it was booked, and its answer is not an error.
    pub measures_rate: bool,
}

impl Booked {
    /// The engine answered with an error status: its first bytes came without a prefill (a
    /// prompt over the model's length is refused at once), so they say nothing of its rate.
    /// Left in, the refusal of a 134,773-token prompt after 12 ms taught a rate 56× the
    /// engine's.
    pub fn answered_in_error(&mut self) {
        self.measures_rate = false;
    }

    /// Whether its first bytes could still be a rate sample: it measures the rate and books
    /// enough prefill for a sample (`mirror::rate_sample`). The filter reads the answer's
    /// status only then.
    pub fn may_teach_rate(&self) -> bool {
        self.measures_rate && self.prefill >= mirror::RATE_SAMPLE_MIN_TOKENS
    }
}

impl<S: Store> Books<'_, S> {
    fn apply(
        &self,
        id: LoadId,
        delta: LoadDelta,
        now: u64,
        seen: Option<(Vec<u8>, u32)>,
    ) -> Result<(), BookError> {
        let wrote = mirror::load_update_seen(
            self.store,
            self.keys,
            seen,
            self.capacity,
            id,
            delta,
            now,
            self.ttl_ms,
        )?;
        if wrote {
            Ok(())
        } else {
            Err(BookError::Full)
        }
    }

    /// Books a routed request on `id` as of the decision's `picture` (its table is written
    /// over without being read again when no other writer came between).
    ///
    /// # Errors
    /// The write failed; nothing is booked.
    pub fn book(
        &self,
        picture: Picture,
        id: LoadId,
        prefill: u32,
        decode: u32,
        idle: bool,
    ) -> Result<Booked, BookError> {
        let delta = LoadDelta {
            requests: 1,
            prefill_tokens: prefill.into(),
            decode_tokens: decode.into(),
            rate: self.prefill_rate.map_or(RateNote::Keep, RateNote::Set),
        };
        let now = picture.now();
        self.apply(id, delta, now, Some(picture.into_table()))?;
        Ok(Booked {
            id,
            prefill,
            decode,
            prefill_open: true,
            at_ms: now,
            measures_rate: idle,
        })
    }

    /// The first response bytes at `now`: the engine has prefilled, the prefill tokens are no
    /// longer work ahead of the next request. Once per booking.
    ///
    /// # Errors
    /// The write failed (the entry's time-to-live repairs it).
    pub fn release_prefill(&self, b: &mut Booked, now: u64) -> Result<(), BookError> {
        if !b.prefill_open {
            return Ok(());
        }
        b.prefill_open = false;
        if b.prefill == 0 {
            return Ok(());
        }
        let delta = LoadDelta {
            prefill_tokens: -i64::from(b.prefill),
            rate: self.rate_note(b, now),
            ..LoadDelta::default()
        };
        self.apply(b.id, delta, now, None)
    }

    /// What the first response bytes at `now` teach of the engine's prefill rate: learned
    /// only from requests that found the engine idle (see `mirror::rate_sample`).
    fn rate_note(&self, b: &Booked, now: u64) -> RateNote {
        let sample = match self.prefill_rate {
            None if b.may_teach_rate() => {
                mirror::rate_sample(b.prefill, now.saturating_sub(b.at_ms))
            }
            _ => None,
        };
        sample.map_or(RateNote::Keep, RateNote::Sample)
    }

    /// The first response bytes and the end of the request at the same `now` (a response
    /// that arrives whole): [`Books::release_prefill`] then [`Books::release`] in one write.
    ///
    /// # Errors
    /// The write failed (the entry's time-to-live repairs it).
    pub fn release_whole(&self, b: Booked, now: u64) -> Result<(), BookError> {
        let rate = if b.prefill_open {
            self.rate_note(&b, now)
        } else {
            RateNote::Keep
        };
        let delta = LoadDelta {
            rate,
            ..Self::release_delta(&b)
        };
        self.apply(b.id, delta, now, None)
    }

    fn release_delta(b: &Booked) -> LoadDelta {
        LoadDelta {
            requests: -1,
            prefill_tokens: if b.prefill_open {
                -i64::from(b.prefill)
            } else {
                0
            },
            decode_tokens: -i64::from(b.decode),
            rate: RateNote::Keep,
        }
    }

    /// The end of the request at `now`: everything still booked.
    ///
    /// # Errors
    /// The write failed (the entry's time-to-live repairs it).
    pub fn release(&self, b: Booked, now: u64) -> Result<(), BookError> {
        self.apply(b.id, Self::release_delta(&b), now, None)
    }
}
