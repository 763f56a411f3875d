//! The keyspace: the fixed set of shared-data keys one plugin's mirror uses, and the bucket a
//! block key lives in.

use crate::scope::BlockKey;

/// Version of every value layout below; part of every key name.
pub const LAYOUT_VERSION: u8 = 3;

/// Most attempts at a compare-and-swap update before giving up (the update is then skipped
/// and counted by the caller).
pub const CAS_RETRIES: u32 = 8;

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
    /// Buckets per generation.
    pub fn buckets(&self) -> u32 {
        1u32 << self.buckets_log2.min(20)
    }
}

/// Key names of one plugin's layout. The fixed ones are made once: the request path names
/// several per request, and formatting each anew costs more in wasm than its read.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
    lease: String,
    vm_seq: String,
    active: String,
    load: String,
    fleet: String,
    gateway: String,
    meta: [String; 2],
}

impl Keys {
    /// The keys of plugin `plugin`.
    pub fn new(plugin: &str) -> Keys {
        let prefix = format!("kvroute/{plugin}/v{LAYOUT_VERSION}");
        let key = |name: &str| format!("{prefix}/{name}");
        Keys {
            lease: key("lease"),
            vm_seq: key("vmseq"),
            active: key("active"),
            load: key("load"),
            fleet: key("fleet"),
            gateway: key("gateway"),
            meta: [key("g0/meta"), key("g1/meta")],
            prefix,
        }
    }

    /// `kvroute/{plugin}/v{LAYOUT_VERSION}`: the start of every key.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The lease key.
    pub fn lease(&self) -> &str {
        &self.lease
    }

    /// The VM-id counter key.
    pub fn vm_seq(&self) -> &str {
        &self.vm_seq
    }

    /// The sync-state key.
    pub fn active(&self) -> &str {
        &self.active
    }

    /// The in-flight load table key.
    pub fn load(&self) -> &str {
        &self.load
    }

    /// The fleet load key (`fleet.rs`).
    pub fn fleet(&self) -> &str {
        &self.fleet
    }

    /// The key holding this Envoy's gateway id, made once.
    pub fn gateway(&self) -> &str {
        &self.gateway
    }

    /// The key of speculative-holder table `shard` (`speculative.rs`): a prompt's entries all
    /// go to the shard of its first block, which its siblings share.
    pub fn speculative(&self, shard: u32) -> String {
        // Hand-rolled as `bucket_into`: one or two of these per request.
        let mut out = String::with_capacity(self.prefix.len() + 16);
        out.push_str(&self.prefix);
        out.push_str("/spec/");
        let digits = shard.checked_ilog10().unwrap_or(0) + 1;
        for i in (0..digits).rev() {
            let d = shard / 10u32.pow(i) % 10;
            out.push(char::from_digit(d, 10).unwrap_or('0'));
        }
        out
    }

    /// The meta key of generation `gen` (0 or 1).
    pub fn meta(&self, gen: u8) -> &str {
        &self.meta[usize::from(gen & 1)]
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

    /// The key of bucket `idx` of generation `gen`.
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
