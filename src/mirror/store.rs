//! Shared data as the mirror reaches it: the [`Store`] trait the filter implements over
//! proxy-wasm host calls, and [`MemStore`], the in-memory one tests and benchmarks use.

use core::cell::{Cell, RefCell};

use super::keys::CAS_RETRIES;

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

/// Read-modify-write of `key` with up to [`CAS_RETRIES`] reads: `change` edits the value
/// (empty when absent) and says whether to write it. `first`: the value and CAS token a
/// caller already read, tried once before reading again. Returns whether it wrote.
///
/// # Errors
/// A host failure, or [`StoreError::CasMismatch`] when every attempt lost a race.
pub fn update_value<S: Store>(
    store: &S,
    key: &str,
    mut first: Option<(Vec<u8>, u32)>,
    mut change: impl FnMut(&mut Vec<u8>) -> bool,
) -> Result<bool, StoreError> {
    for _ in 0..CAS_RETRIES + u32::from(first.is_some()) {
        let (mut value, cas) = match first.take() {
            Some(f) => f,
            None => {
                let (v, cas) = store.get(key)?;
                (v.unwrap_or_default(), cas)
            }
        };
        if !change(&mut value) {
            return Ok(false);
        }
        match store.set(key, &value, cas) {
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
    /// An empty store.
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

    /// Every key written, in no order.
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
