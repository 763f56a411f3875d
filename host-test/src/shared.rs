//! State shared by every VM of one [`crate::Gateway`]: what Envoy keeps per process or per
//! `vm_id` rather than per VM (shared data, queues, stats), plus the test's clock and knobs.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::abi::{LogLevel, MetricKind};
use crate::types::{ForeignFn, LogEntry};

/// One shared-data entry: value and CAS token.
#[derive(Clone, Debug)]
pub(crate) struct SharedEntry {
    pub value: Vec<u8>,
    pub cas: u32,
}

/// Shared data of one `vm_id`, with proxy-wasm-cpp-host's semantics (src/shared_data.cc):
/// the CAS is checked only when the key exists, a missing key is always inserted, every write
/// takes the next value of one global counter (skipping 0), and keys are never deleted: the
/// ABI 0.2.1 "remove" stores an empty value.
#[derive(Debug, Default)]
pub(crate) struct SharedData {
    pub map: HashMap<Vec<u8>, SharedEntry>,
    next_cas: u32,
}

impl SharedData {
    fn next_cas(&mut self) -> u32 {
        self.next_cas = self.next_cas.wrapping_add(1);
        if self.next_cas == 0 {
            self.next_cas = 1;
        }
        self.next_cas
    }

    /// `Err(())` is a CAS mismatch.
    pub fn set(&mut self, key: &[u8], value: &[u8], cas: u32) -> Result<u32, ()> {
        if let Some(e) = self.map.get(key) {
            if cas != 0 && cas != e.cas {
                return Err(());
            }
        }
        let cas = self.next_cas();
        self.map.insert(
            key.to_vec(),
            SharedEntry {
                value: value.to_vec(),
                cas,
            },
        );
        Ok(cas)
    }
}

/// A shared queue (cpp-host src/shared_queue.cc): keyed by `(vm_id, name)`; the last VM that
/// registered it is the one told `on_queue_ready`.
#[derive(Debug)]
pub(crate) struct Queue {
    pub vm_id: String,
    pub name: String,
    pub owner_vm: usize,
    pub owner_root: u32,
    pub items: std::collections::VecDeque<Vec<u8>>,
}

#[derive(Debug, Default)]
pub(crate) struct Queues {
    pub by_token: BTreeMap<u32, Queue>,
    next_token: u32,
}

impl Queues {
    pub fn register(&mut self, vm_id: &str, name: &str, vm: usize, root: u32) -> u32 {
        if let Some((token, q)) = self
            .by_token
            .iter_mut()
            .find(|(_, q)| q.vm_id == vm_id && q.name == name)
        {
            q.owner_vm = vm;
            q.owner_root = root;
            return *token;
        }
        self.next_token += 1;
        let token = self.next_token;
        self.by_token.insert(
            token,
            Queue {
                vm_id: vm_id.to_string(),
                name: name.to_string(),
                owner_vm: vm,
                owner_root: root,
                items: Default::default(),
            },
        );
        token
    }

    pub fn resolve(&self, vm_id: &str, name: &str) -> Option<u32> {
        self.by_token
            .iter()
            .find(|(_, q)| q.vm_id == vm_id && q.name == name)
            .map(|(t, _)| *t)
    }
}

/// One metric: Envoy keeps stats per process, so every VM defining the same name shares it.
#[derive(Clone, Debug)]
pub(crate) struct Metric {
    pub name: String,
    pub kind: MetricKind,
    pub value: u64,
    pub samples: Vec<u64>,
}

/// A closure answering the callouts to one cluster, or a loopback address to forward them to.
pub(crate) enum ClusterTarget {
    Handler(crate::types::CalloutHandler),
    Forward(std::net::SocketAddr),
    Manual,
}

#[derive(Default)]
pub(crate) struct Inner {
    pub shared_data: SharedData,
    pub queues: Queues,
    pub metrics: Vec<Metric>,
    pub logs: Vec<LogEntry>,
    /// Properties every stream sees (route name, metadata paths, ...), by path segments.
    pub properties: HashMap<Vec<String>, Vec<u8>>,
    pub foreign: HashMap<String, ForeignFn>,
    /// Every foreign function call: name and arguments.
    pub foreign_calls: Vec<(String, Vec<u8>)>,
    /// Higress `proxy_get_upstream_hosts`: `(address, JSON info)`.
    pub upstream_hosts: Vec<(String, String)>,
    pub clusters: HashMap<String, ClusterTarget>,
    /// Test clock, nanoseconds since the Unix epoch.
    pub now_nanos: u64,
    /// Queue notifications to deliver: `(vm, root context, token)`.
    pub queue_ready: Vec<(usize, u32, u32)>,
    pub log_level: Option<LogLevel>,
    /// Every callout ever dispatched, in order.
    pub callouts: Vec<crate::types::Callout>,
}

/// Cheap handle; every VM's store holds one.
#[derive(Clone, Default)]
pub(crate) struct Shared(Arc<Mutex<Inner>>);

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while the lock is held (a test closure) must not poison the whole host.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
