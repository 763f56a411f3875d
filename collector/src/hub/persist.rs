//! The hub's persistence job: the state `--state-dir` keeps, exported and imported. Import
//! checks the whole file before it changes anything, so a file that parses but contradicts
//! itself is refused as a whole (and moved aside by the caller), never half loaded.

use std::collections::{HashMap, HashSet};

use kvroute::api::RegisterRequest;
use kvroute::event::WorkerId;
use kvroute::index::{Index, IndexDump, WorkerDump};
use kvroute::scope::ModelKey;
use serde::{Deserialize, Serialize};

use super::store::{Alias, Hub};
use super::types::{HubError, WorkerInfo, WorkerStatus, MAX_WORKERS};

/// The one state version this build reads and writes.
pub const STATE_VERSION: u32 = 1;

/// The persisted state (`--state-dir`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StateFile {
    pub version: u32,
    pub workers: Vec<SavedWorker>,
    pub aliases: Vec<SavedAlias>,
    pub index: IndexDump,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedWorker {
    pub id: u32,
    pub reg: RegisterRequest,
    pub source: Option<u32>,
    pub last_seq: Option<u64>,
    /// See `WorkerStatus::last_hash` (absent in older files: the batch is not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_hash: Option<u64>,
}

/// A worker's last applied sequence number and the hash of that batch's payload.
type SavedSeq = (Option<u64>, Option<u64>);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedAlias {
    pub tenant: String,
    pub served: String,
    pub model: String,
    pub lora: Option<String>,
    /// The registration whose events taught it (absent in older files: a registration's own).
    #[serde(default)]
    pub owner: Option<u32>,
}

impl Hub {
    /// The state to persist.
    pub fn export(&self) -> StateFile {
        let mut state = self.export_head();
        state.index = self.index.export();
        state
    }

    /// The state to persist without the index's blocks (`index.workers` empty): the
    /// registrations, whose blocks [`Hub::export_blocks`] then gives one worker at a time.
    pub fn export_head(&self) -> StateFile {
        StateFile {
            version: STATE_VERSION,
            workers: self
                .workers()
                .map(|w| SavedWorker {
                    id: w.id.0,
                    reg: w.reg.clone(),
                    source: w.source.map(|s| s.0),
                    last_seq: w.status.last_seq,
                    last_hash: w.status.last_hash,
                })
                .collect(),
            aliases: self
                .aliases
                .iter()
                .map(|((tenant, served), a)| SavedAlias {
                    tenant: tenant.clone(),
                    served: served.clone(),
                    model: a.model.clone(),
                    lora: a.lora.clone(),
                    owner: a.owner.map(|o| o.0),
                })
                .collect(),
            index: IndexDump {
                version: 1,
                workers: Vec::new(),
            },
        }
    }

    /// The blocks of the worker `saved` names, if they still go with that registration (the
    /// worker may have left, or its id gone to another, since the head was taken: such blocks
    /// would make the file refused as a whole).
    pub fn export_blocks(&self, saved: &SavedWorker) -> Option<WorkerDump> {
        self.index
            .export_worker(saved.id)
            .filter(|d| dump_matches(&saved.reg, d))
    }

    /// Loads a persisted state into this (empty) hub. Returns the registered workers with the
    /// sequence number to replay from.
    ///
    /// # Errors
    /// [`HubError::BadRequest`] naming the first inconsistency: an unknown version, a bad
    /// registration (block size 0, ...), a worker id out of range or saved twice, a sibling
    /// or alias naming a worker or model the file lacks, index blocks of an unknown worker.
    /// The hub is then left unchanged.
    pub fn import(&mut self, state: StateFile) -> Result<Vec<(WorkerId, Option<u64>)>, HubError> {
        let bad = |m: String| HubError::BadRequest(m);
        if state.version != STATE_VERSION || state.index.version != 1 {
            return Err(bad(format!(
                "state version {} (index {}) is not {STATE_VERSION}",
                state.version, state.index.version
            )));
        }
        if !self.workers.is_empty() {
            return Err(bad("state imported into a hub that has workers".into()));
        }
        // Check everything first; change nothing until all of it holds.
        let mut regs: HashMap<u32, (RegisterRequest, Option<u32>, SavedSeq)> = HashMap::new();
        let mut names = HashSet::new();
        let mut sizes: HashMap<ModelKey, u32> = HashMap::new();
        for w in state.workers {
            if w.id as usize >= MAX_WORKERS {
                return Err(bad(format!("worker id {} out of range", w.id)));
            }
            let reg = self
                .normalize(w.reg)
                .map_err(|e| bad(format!("worker {}: {e}", w.id)))?;
            if !names.insert((reg.instance_id.clone(), reg.dp_rank.unwrap_or(0))) {
                return Err(bad(format!(
                    "worker {:?} dp_rank {} saved twice",
                    reg.instance_id,
                    reg.dp_rank.unwrap_or(0)
                )));
            }
            let model = ModelKey::new(reg.tenant_id.as_deref().unwrap_or(""), &reg.model_name);
            if *sizes.entry(model).or_insert(reg.block_size) != reg.block_size {
                return Err(bad(format!(
                    "model {:?} saved with two block sizes",
                    reg.model_name
                )));
            }
            if regs
                .insert(w.id, (reg, w.source, (w.last_seq, w.last_hash)))
                .is_some()
            {
                return Err(bad(format!("worker id {} saved twice", w.id)));
            }
        }
        for (id, (_, source, _)) in &regs {
            if let Some(s) = source {
                if !matches!(regs.get(s), Some((_, None, _))) {
                    return Err(bad(format!(
                        "worker {id} names source {s}, which is no registered worker"
                    )));
                }
            }
        }
        let mut dumped = HashSet::new();
        for d in &state.index.workers {
            let Some((reg, _, _)) = regs.get(&d.worker) else {
                return Err(bad(format!("index blocks of unknown worker {}", d.worker)));
            };
            if !dumped.insert(d.worker) || !dump_matches(reg, d) {
                return Err(bad(format!(
                    "index blocks of worker {} do not match its registration",
                    d.worker
                )));
            }
        }
        if state.aliases.len() > self.config.limits.aliases {
            return Err(bad(format!(
                "{} aliases, more than the limit of {}",
                state.aliases.len(),
                self.config.limits.aliases
            )));
        }
        for a in &state.aliases {
            if !sizes.contains_key(&ModelKey::new(&a.tenant, &a.model))
                || sizes.contains_key(&ModelKey::new(&a.tenant, &a.served))
                || a.owner
                    .is_some_and(|o| !matches!(regs.get(&o), Some((_, None, _))))
            {
                return Err(bad(format!(
                    "alias {:?} of tenant {:?} names an unknown model or owner, or a model",
                    a.served, a.tenant
                )));
            }
        }

        let mut out = Vec::new();
        let mut ids: Vec<u32> = regs.keys().copied().collect();
        ids.sort_unstable();
        if let Some(&last) = ids.last() {
            self.workers.resize(last as usize + 1, None);
        }
        for id in ids {
            let (reg, source, (last_seq, last_hash)) = regs.remove(&id).expect("listed");
            let model = ModelKey::new(reg.tenant_id.as_deref().unwrap_or(""), &reg.model_name);
            self.sizes
                .register(&model, reg.block_size)
                .map_err(|e| bad(e.to_string()))?;
            *self.model_workers.entry(model).or_insert(0) += 1;
            self.by_name.insert(
                (reg.instance_id.clone(), reg.dp_rank.unwrap_or(0)),
                WorkerId(id),
            );
            if source.is_some() {
                self.derived += 1;
            } else {
                out.push((WorkerId(id), last_seq));
            }
            let generation = self.next_generation;
            self.next_generation += 1;
            self.workers[id as usize] = Some(WorkerInfo {
                id: WorkerId(id),
                reg,
                source: source.map(WorkerId),
                status: WorkerStatus {
                    last_seq,
                    last_hash,
                    ..WorkerStatus::default()
                },
                generation,
            });
        }
        for a in state.aliases {
            let owner = a.owner.map(WorkerId);
            if let Some(o) = owner {
                *self.learned.entry(o).or_insert(0) += 1;
            }
            self.aliases.insert(
                (a.tenant, a.served),
                Alias {
                    model: a.model,
                    lora: a.lora,
                    owner,
                },
            );
        }
        self.index = Index::import(self.index.config(), &state.index);
        // Workers the dump lacks (none had blocks) still need their scope in the index.
        for w in self.workers.iter().flatten() {
            if !self.index.has_worker(w.id) {
                self.index
                    .add_worker(w.id, w.tenant(), &w.reg.model_name, w.reg.block_size);
            }
        }
        Ok(out)
    }
}

/// Whether a worker's index blocks belong to its registration.
fn dump_matches(reg: &RegisterRequest, d: &WorkerDump) -> bool {
    reg.tenant_id.as_deref() == Some(d.tenant.as_str())
        && reg.model_name == d.model
        && reg.block_size == d.block_size
}
