//! The meta table of a generation: worker slots, block sizes and model aliases, and how the
//! feed's non-block ops change it.

use crate::codec::{put_str_u16, Reader};
use crate::feed::Op;

use super::keys::{Limits, LAYOUT_VERSION};

/// One worker slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSlot {
    /// Registered and not gone: only live workers are routed to.
    pub live: bool,
    /// Its data-parallel rank within its instance.
    pub dp_rank: u32,
    /// The engine instance it belongs to.
    pub instance_id: String,
    /// Where its instance takes requests (`host:port`).
    pub address: String,
    /// The registration's tenant and model: a request is routed only to its model's workers
    /// (empty: unknown, a candidate for any model).
    pub tenant: String,
    /// See `tenant`.
    pub model: String,
}

/// A served name's resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alias {
    /// The tenant the alias belongs to.
    pub tenant: String,
    /// The model name clients send.
    pub served: String,
    /// The base model it resolves to.
    pub model: String,
    /// The LoRA adapter it resolves to, if any.
    pub lora: Option<String>,
}

/// A generation's worker table, block sizes and aliases.
///
/// # Layout
///
/// ```text
/// version u8, stamp u32
/// nw u16, nw × (slot u16, live u8, dp_rank u32, instance str, address str, tenant str, model str)
/// ns u16, ns × (tenant str, model str, block_size u32)
/// na u16, na × (tenant str, served str, model str, lora str ("" = none))
/// str = len u16, UTF-8 bytes
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    /// Indexed by slot (= the feed's worker id); `None` is a free slot.
    pub workers: Vec<Option<WorkerSlot>>,
    /// `(tenant, model, block size)` of each known model.
    pub block_sizes: Vec<(String, String, u32)>,
    /// Served-name aliases.
    pub aliases: Vec<Alias>,
}

/// Counts of what a page did, for the filter's metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Block holds added or removed.
    pub blocks: u64,
    /// Bucket values written.
    pub bucket_writes: u64,
    /// Block adds dropped because a bucket was full.
    pub bucket_full: u64,
    /// Ops naming a worker id at or above `max_workers`.
    pub bad_workers: u64,
    /// Block sizes or aliases dropped past `max_models`.
    pub models_dropped: u64,
}

impl Meta {
    /// Parses a meta value of build `stamp`; another build, layout or a damaged value is `None`.
    pub fn decode(bytes: &[u8], stamp: u32) -> Option<Meta> {
        let mut r = Reader::new(bytes);
        if r.u8().ok()? != LAYOUT_VERSION || r.u32().ok()? != stamp {
            return None;
        }
        let mut m = Meta::default();
        for _ in 0..r.u16().ok()? {
            let slot = r.u16().ok()? as usize;
            let live = r.u8().ok()? != 0;
            let dp_rank = r.u32().ok()?;
            let instance_id = r.str_u16().ok()?;
            let address = r.str_u16().ok()?;
            let tenant = r.str_u16().ok()?;
            let model = r.str_u16().ok()?;
            if m.workers.len() <= slot {
                m.workers.resize(slot + 1, None);
            }
            m.workers[slot] = Some(WorkerSlot {
                live,
                dp_rank,
                instance_id,
                address,
                tenant,
                model,
            });
        }
        for _ in 0..r.u16().ok()? {
            let t = r.str_u16().ok()?;
            let model = r.str_u16().ok()?;
            let bs = r.u32().ok()?;
            m.block_sizes.push((t, model, bs));
        }
        for _ in 0..r.u16().ok()? {
            let tenant = r.str_u16().ok()?;
            let served = r.str_u16().ok()?;
            let model = r.str_u16().ok()?;
            let lora = r.str_u16().ok()?;
            m.aliases.push(Alias {
                tenant,
                served,
                model,
                lora: (!lora.is_empty()).then_some(lora),
            });
        }
        (r.position() == bytes.len()).then_some(m)
    }

    /// The meta value for build `stamp`.
    pub fn encode(&self, stamp: u32) -> Vec<u8> {
        let mut out = vec![LAYOUT_VERSION];
        out.extend_from_slice(&stamp.to_le_bytes());
        let live: Vec<(usize, &WorkerSlot)> = self
            .workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.as_ref().map(|w| (i, w)))
            .collect();
        out.extend_from_slice(&(live.len() as u16).to_le_bytes());
        for (slot, w) in live {
            out.extend_from_slice(&(slot as u16).to_le_bytes());
            out.push(w.live as u8);
            out.extend_from_slice(&w.dp_rank.to_le_bytes());
            put_str_u16(&mut out, &w.instance_id);
            put_str_u16(&mut out, &w.address);
            put_str_u16(&mut out, &w.tenant);
            put_str_u16(&mut out, &w.model);
        }
        out.extend_from_slice(&(self.block_sizes.len() as u16).to_le_bytes());
        for (t, m, bs) in &self.block_sizes {
            put_str_u16(&mut out, t);
            put_str_u16(&mut out, m);
            out.extend_from_slice(&bs.to_le_bytes());
        }
        out.extend_from_slice(&(self.aliases.len() as u16).to_le_bytes());
        for a in &self.aliases {
            put_str_u16(&mut out, &a.tenant);
            put_str_u16(&mut out, &a.served);
            put_str_u16(&mut out, &a.model);
            put_str_u16(&mut out, a.lora.as_deref().unwrap_or(""));
        }
        out
    }

    /// The block size of `(tenant, model)`.
    pub fn block_size(&self, tenant: &str, model: &str) -> Option<u32> {
        self.block_sizes
            .iter()
            .find(|(t, m, _)| t == tenant && m == model)
            .map(|e| e.2)
    }

    /// Resolves a served model name: `(model, lora)`; a name without alias is itself.
    pub fn resolve<'a>(&'a self, tenant: &str, served: &'a str) -> (&'a str, Option<&'a str>) {
        match self
            .aliases
            .iter()
            .find(|a| a.tenant == tenant && a.served == served)
        {
            Some(a) => (&a.model, a.lora.as_deref()),
            None => (served, None),
        }
    }

    /// The worker in slot `slot`, if any.
    pub fn worker(&self, slot: u32) -> Option<&WorkerSlot> {
        self.workers.get(slot as usize).and_then(Option::as_ref)
    }

    /// Builds the metadata a filter holds after applying `ops` (non-block ops; block ops
    /// are ignored) under `limits`: what a collector-side caller uses to see its registry as
    /// the filters do.
    pub fn from_ops<'a>(ops: impl IntoIterator<Item = &'a Op>, limits: &Limits) -> Meta {
        let mut meta = Meta::default();
        let mut stats = ApplyStats::default();
        for op in ops {
            meta.apply(op, limits, &mut stats);
        }
        meta
    }

    /// Applies one non-block op. Returns whether anything changed.
    pub(super) fn apply(&mut self, op: &Op, limits: &Limits, stats: &mut ApplyStats) -> bool {
        match op {
            Op::Worker {
                id,
                live,
                dp_rank,
                instance_id,
                address,
                tenant,
                model,
            } => {
                if id.0 >= limits.max_workers {
                    stats.bad_workers += 1;
                    return false;
                }
                let slot = id.0 as usize;
                if self.workers.len() <= slot {
                    self.workers.resize(slot + 1, None);
                }
                let w = WorkerSlot {
                    live: *live,
                    dp_rank: *dp_rank,
                    instance_id: instance_id.clone(),
                    address: address.clone(),
                    tenant: tenant.clone(),
                    model: model.clone(),
                };
                let changed = self.workers[slot].as_ref() != Some(&w);
                self.workers[slot] = Some(w);
                changed
            }
            Op::WorkerGone { id } => match self.workers.get_mut(id.0 as usize) {
                Some(w) if w.is_some() => {
                    *w = None;
                    true
                }
                _ => false,
            },
            Op::BlockSize {
                tenant,
                model,
                block_size,
            } => {
                if let Some(e) = self
                    .block_sizes
                    .iter_mut()
                    .find(|(t, m, _)| t == tenant && m == model)
                {
                    let changed = e.2 != *block_size;
                    e.2 = *block_size;
                    return changed;
                }
                if self.block_sizes.len() + self.aliases.len() >= limits.max_models as usize {
                    stats.models_dropped += 1;
                    return false;
                }
                self.block_sizes
                    .push((tenant.clone(), model.clone(), *block_size));
                true
            }
            Op::Alias {
                tenant,
                served,
                model,
                lora,
            } => {
                let a = Alias {
                    tenant: tenant.clone(),
                    served: served.clone(),
                    model: model.clone(),
                    lora: lora.clone(),
                };
                if let Some(e) = self
                    .aliases
                    .iter_mut()
                    .find(|a| &a.tenant == tenant && &a.served == served)
                {
                    let changed = *e != a;
                    *e = a;
                    return changed;
                }
                if self.block_sizes.len() + self.aliases.len() >= limits.max_models as usize {
                    stats.models_dropped += 1;
                    return false;
                }
                self.aliases.push(a);
                true
            }
            Op::Blocks { .. } | Op::Load { .. } | Op::Stream(_) | Op::Held { .. } => false,
        }
    }
}
