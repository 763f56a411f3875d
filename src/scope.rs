//! Index scopes: `(tenant_id, model_name, lora_name, cache_salt)`.
//!
//! Blocks of different scopes never match, whatever their sequence hashes. Rather than keep a
//! scope next to every block, the index and the filter key blocks by a [`BlockKey`] that mixes
//! the scope's compact [`ScopeId`] into the sequence hash. Two keys of different scopes collide
//! with probability 2^-64 per pair, the same odds every 64-bit prefix hash already lives with.

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64;

use crate::hash::{self, SeqHash};

/// The tenant used when a request or registration names none.
pub const DEFAULT_TENANT: &str = "default";

/// A full scope, as named by registrations, events and requests.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Scope {
    /// Tenant (`default` when none is given).
    pub tenant: String,
    /// Base model name.
    pub model: String,
    /// LoRA adapter, if any.
    pub lora_name: Option<String>,
    /// Cache salt, if any.
    pub cache_salt: Option<String>,
}

impl Scope {
    /// A scope; empty LoRA and salt names count as absent.
    pub fn new(
        tenant: &str,
        model: &str,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Self {
        let none_if_empty = |s: Option<&str>| s.filter(|s| !s.is_empty()).map(str::to_owned);
        Scope {
            tenant: if tenant.is_empty() {
                DEFAULT_TENANT.to_owned()
            } else {
                tenant.to_owned()
            },
            model: model.to_owned(),
            lora_name: none_if_empty(lora_name),
            cache_salt: none_if_empty(cache_salt),
        }
    }

    /// The scope's id: what block keys are mixed with.
    pub fn id(&self) -> ScopeId {
        ScopeId::of(
            &self.tenant,
            &self.model,
            self.lora_name.as_deref(),
            self.cache_salt.as_deref(),
        )
    }

    /// The hashing-contract seed of this scope's blocks.
    pub fn seed(&self) -> u64 {
        hash::seed(self.lora_name.as_deref(), self.cache_salt.as_deref())
    }

    /// The model the scope belongs to.
    pub fn model_key(&self) -> ModelKey {
        ModelKey {
            tenant: self.tenant.clone(),
            model: self.model.clone(),
        }
    }
}

/// Compact id of a scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeId(pub u64);

impl ScopeId {
    /// Hashes the four parts, each length-prefixed so that no two scopes share an encoding.
    /// An empty tenant is the default tenant; an empty LoRA name or salt is none.
    pub fn of(
        tenant: &str,
        model: &str,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Self {
        let tenant = if tenant.is_empty() {
            DEFAULT_TENANT
        } else {
            tenant
        };
        let parts = [
            tenant,
            model,
            lora_name.unwrap_or(""),
            cache_salt.unwrap_or(""),
        ];
        let mut buf = Vec::with_capacity(parts.iter().map(|p| p.len() + 4).sum());
        for part in parts {
            buf.extend_from_slice(&(part.len() as u32).to_le_bytes());
            buf.extend_from_slice(part.as_bytes());
        }
        ScopeId(xxh3_64(&buf))
    }

    /// The index key of the block that ends the prefix `seq` in this scope. Both parts are
    /// already uniform 64-bit hashes, so a xor separates scopes as well as rehashing would,
    /// and it can be undone: the index keeps only keys and recovers sequence hashes with
    /// [`ScopeId::seq`] to chain children.
    #[inline]
    pub fn key(self, seq: SeqHash) -> BlockKey {
        BlockKey(seq.0 ^ self.0)
    }

    /// The sequence hash behind a key of this scope.
    #[inline]
    pub fn seq(self, key: BlockKey) -> SeqHash {
        SeqHash(key.0 ^ self.0)
    }
}

/// A block's key in the index: its scope mixed with its sequence hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

/// `(tenant_id, model_name)`: the unit that has one block size.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelKey {
    /// Tenant.
    pub tenant: String,
    /// Model name.
    pub model: String,
}

impl ModelKey {
    /// The key of `(tenant, model)`.
    pub fn new(tenant: &str, model: &str) -> Self {
        let tenant = if tenant.is_empty() {
            DEFAULT_TENANT
        } else {
            tenant
        };
        ModelKey {
            tenant: tenant.to_owned(),
            model: model.to_owned(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
/// Why a block size was refused.
pub enum BlockSizeError {
    #[error("block size must be at least 1 token")]
    /// A block size of 0 tokens.
    Zero,
    #[error(
        "model {model:?} of tenant {tenant:?} already has block size {existing}, not {requested}"
    )]
    /// The model already has another block size.
    Conflict {
        /// The model's tenant.
        tenant: String,
        /// The model.
        model: String,
        /// The block size it has.
        existing: u32,
        /// The block size asked for.
        requested: u32,
    },
}

/// The block size of each `(tenant, model)`: the first registration fixes it.
#[derive(Clone, Debug, Default)]
pub struct BlockSizes {
    sizes: HashMap<ModelKey, u32>,
}

impl BlockSizes {
    /// Records `size` for `key`, or checks it against the size already recorded.
    pub fn register(&mut self, key: &ModelKey, size: u32) -> Result<(), BlockSizeError> {
        if size == 0 {
            return Err(BlockSizeError::Zero);
        }
        match self.sizes.get(key) {
            Some(&existing) if existing != size => Err(BlockSizeError::Conflict {
                tenant: key.tenant.clone(),
                model: key.model.clone(),
                existing,
                requested: size,
            }),
            Some(_) => Ok(()),
            None => {
                self.sizes.insert(key.clone(), size);
                Ok(())
            }
        }
    }

    /// The block size of `key`, if registered.
    pub fn get(&self, key: &ModelKey) -> Option<u32> {
        self.sizes.get(key).copied()
    }

    /// Forgets a model, once its last worker has gone.
    pub fn remove(&mut self, key: &ModelKey) -> Option<u32> {
        self.sizes.remove(key)
    }

    /// Every registered model and its block size.
    pub fn iter(&self) -> impl Iterator<Item = (&ModelKey, u32)> {
        self.sizes.iter().map(|(k, &v)| (k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_parts_do_not_run_into_each_other() {
        assert_ne!(
            ScopeId::of("ab", "c", None, None),
            ScopeId::of("a", "bc", None, None)
        );
        assert_ne!(
            ScopeId::of("t", "m", Some("x"), None),
            ScopeId::of("t", "m", None, Some("x"))
        );
        assert_eq!(
            ScopeId::of("", "m", None, None),
            ScopeId::of(DEFAULT_TENANT, "m", None, None)
        );
        assert_eq!(
            Scope::new("", "m", Some(""), None).id(),
            ScopeId::of("default", "m", None, None)
        );
    }

    #[test]
    fn same_sequence_in_two_scopes_gets_two_keys() {
        let seq = SeqHash(42);
        assert_ne!(
            ScopeId::of("a", "m", None, None).key(seq),
            ScopeId::of("b", "m", None, None).key(seq)
        );
    }

    #[test]
    fn first_registration_fixes_block_size() {
        let mut sizes = BlockSizes::default();
        let key = ModelKey::new("t", "m");
        assert_eq!(sizes.register(&key, 0), Err(BlockSizeError::Zero));
        sizes.register(&key, 16).unwrap();
        sizes.register(&key, 16).unwrap();
        assert!(matches!(
            sizes.register(&key, 32),
            Err(BlockSizeError::Conflict { existing: 16, .. })
        ));
        sizes.register(&ModelKey::new("other", "m"), 32).unwrap();
        assert_eq!(sizes.get(&key), Some(16));
    }
}
