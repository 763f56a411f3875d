//! The hub's registry job: registrations, the workers batches' dp ranks name, served-name
//! aliases, and taking all of it away again (`/unregister`, restarts, long disconnections).

use std::net::{IpAddr, SocketAddr};

use kvroute::api::{RegisterRequest, UnregisterRequest};
use kvroute::event::WorkerId;
use kvroute::feed::Op;
use kvroute::scope::{ModelKey, DEFAULT_TENANT};
use tracing::warn;

use super::store::{worker_op, Alias, Hub};
use super::types::{
    EventStream, HubError, Limit, Registered, WorkerInfo, WorkerStatus, MAX_NAME_BYTES, MAX_WORKERS,
};

impl Hub {
    /// Validates and normalizes a registration: names, endpoint, serving address.
    ///
    /// # Errors
    /// [`HubError::BadRequest`] naming the field.
    pub fn normalize(&self, mut req: RegisterRequest) -> Result<RegisterRequest, HubError> {
        let bad = |m: String| HubError::BadRequest(m);
        check_name("instance_id", &req.instance_id, false)?;
        check_name("model_name", &req.model_name, false)?;
        if let Some(t) = &req.tenant_id {
            check_name("tenant_id", t, true)?;
        }
        for (field, v) in [
            ("lora_name", &req.lora_name),
            ("cache_salt", &req.cache_salt),
        ] {
            if let Some(v) = v {
                check_name(field, v, true)?;
            }
        }
        if req.block_size == 0 {
            return Err(bad("block_size must be at least 1".into()));
        }
        let host = endpoint_host(&req.endpoint)
            .map_err(|m| bad(format!("endpoint {:?}: {m}", req.endpoint)))?;
        if let Some(r) = &req.replay_endpoint {
            endpoint_host(r).map_err(|m| bad(format!("replay_endpoint {r:?}: {m}")))?;
        }
        let address = match &req.address {
            Some(a) => a
                .parse::<SocketAddr>()
                .map_err(|_| bad(format!("address {a:?} is not an ip:port literal (Envoy's override_host needs an IP)")))?,
            None => match (host.parse::<IpAddr>(), self.config.default_serving_port) {
                (Ok(ip), Some(port)) if !ip.is_unspecified() => SocketAddr::new(ip, port),
                _ => req.instance_id.parse::<SocketAddr>().map_err(|_| {
                    bad("no serving address: give \"address\" as ip:port, or an endpoint with an IP and \
                         --default-serving-port, or an instance_id that is ip:port"
                        .into())
                })?,
            },
        };
        req.address = Some(address.to_string());
        req.tenant_id = Some(
            req.tenant_id
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| DEFAULT_TENANT.to_owned()),
        );
        req.dp_rank = Some(req.dp_rank.unwrap_or(0));
        req.lora_name = req.lora_name.filter(|s| !s.is_empty());
        req.cache_salt = req.cache_salt.filter(|s| !s.is_empty());
        Ok(req)
    }

    /// Registers a worker.
    ///
    /// # Errors
    /// Bad input (400), the same worker registered differently or another block size for the
    /// model (409).
    pub fn register(&mut self, req: RegisterRequest) -> Result<Registered, HubError> {
        let req = self.normalize(req)?;
        let dp = req.dp_rank.unwrap_or(0);
        if let Some(&id) = self.by_name.get(&(req.instance_id.clone(), dp)) {
            let existing = self.worker(id).expect("interned worker exists");
            if existing.source.is_none() && existing.reg == req {
                return Ok(Registered::Same(id));
            }
            if existing.source.is_some() && same_but_dp(&existing.reg, &req) {
                // A worker first seen through a batch's dp rank, now registered itself.
                let w = self.worker_mut(id).expect("exists");
                w.source = None;
                w.reg = req;
                self.derived -= 1;
                return Ok(Registered::New(id));
            }
            return Err(HubError::Conflict(format!(
                "worker {:?} dp_rank {dp} is already registered with other settings",
                req.instance_id
            )));
        }
        let tenant = req.tenant_id.clone().unwrap_or_default();
        let model = ModelKey::new(&tenant, &req.model_name);
        let first_of_model = self.sizes.get(&model).is_none();
        self.sizes
            .register(&model, req.block_size)
            .map_err(|e| HubError::Conflict(e.to_string()))?;
        let id = self.insert_worker(req, None).inspect_err(|_| {
            if first_of_model {
                self.sizes.remove(&model);
            }
        })?;
        // A registered model name wins over an alias of the same name: it was only ever a
        // served name some engine's events used.
        self.aliases.remove(&(tenant, model.model.clone()));
        Ok(Registered::New(id))
    }

    pub(crate) fn insert_worker(
        &mut self,
        req: RegisterRequest,
        source: Option<WorkerId>,
    ) -> Result<WorkerId, HubError> {
        let slot = match self.workers.iter().position(Option::is_none) {
            Some(s) => s,
            None if self.workers.len() < MAX_WORKERS => {
                self.workers.push(None);
                self.workers.len() - 1
            }
            None => return Err(HubError::Conflict(format!("at most {MAX_WORKERS} workers"))),
        };
        let id = WorkerId(slot as u32);
        let tenant = req
            .tenant_id
            .clone()
            .unwrap_or_else(|| DEFAULT_TENANT.to_owned());
        let model = ModelKey::new(&tenant, &req.model_name);
        let count = self.model_workers.entry(model.clone()).or_insert(0);
        *count += 1;
        if *count == 1 {
            self.feed.push_op(Op::BlockSize {
                tenant: tenant.clone(),
                model: req.model_name.clone(),
                block_size: req.block_size,
            });
        }
        self.index
            .add_worker(id, &tenant, &req.model_name, req.block_size);
        if source.is_none() {
            if let Some(lora) = req.lora_name.clone() {
                if let Err(limit) = self.add_alias(&tenant, &lora, &req.model_name, None) {
                    warn!(
                        lora,
                        reason = limit.as_str(),
                        "registration's lora_name not served as a model name"
                    );
                }
            }
        } else {
            self.derived += 1;
        }
        self.by_name
            .insert((req.instance_id.clone(), req.dp_rank.unwrap_or(0)), id);
        let generation = self.next_generation;
        self.next_generation += 1;
        let info = WorkerInfo {
            id,
            reg: req,
            source,
            status: WorkerStatus::default(),
            generation,
        };
        self.feed.push_op(worker_op(&info));
        self.workers[slot] = Some(info);
        Ok(id)
    }

    /// Makes `served` (in `tenant`) resolve to `model` with LoRA `served`. `owner` is the
    /// registration whose events name it (`None`: a registration's own `lora_name`).
    ///
    /// # Errors
    /// The [`Limit`] that refused it: a registered model's name, another model's alias, or a
    /// cap reached.
    pub(crate) fn add_alias(
        &mut self,
        tenant: &str,
        served: &str,
        model: &str,
        owner: Option<WorkerId>,
    ) -> Result<(), Limit> {
        let key = (tenant.to_owned(), served.to_owned());
        if let Some(a) = self.aliases.get(&key) {
            return if a.model == model && a.lora.as_deref() == Some(served) {
                Ok(())
            } else {
                Err(Limit::AliasTaken)
            };
        }
        if self.sizes.get(&ModelKey::new(tenant, served)).is_some() {
            return Err(Limit::AliasIsModel);
        }
        if self.aliases.len() >= self.config.limits.aliases {
            return Err(Limit::Aliases);
        }
        if let Some(o) = owner {
            let n = self.learned.entry(o).or_insert(0);
            if *n >= self.config.limits.aliases_per_worker {
                return Err(Limit::AliasesPerWorker);
            }
            *n += 1;
        }
        self.aliases.insert(
            key,
            Alias {
                model: model.to_owned(),
                lora: Some(served.to_owned()),
                owner,
            },
        );
        self.feed.push_op(Op::Alias {
            tenant: tenant.to_owned(),
            served: served.to_owned(),
            model: model.to_owned(),
            lora: Some(served.to_owned()),
        });
        Ok(())
    }

    /// Unregisters the matching workers (all dp ranks when none is named) and the workers
    /// derived from their publishers. Returns the removed registered workers (their
    /// subscribers must stop).
    ///
    /// # Errors
    /// [`HubError::NotFound`] when nothing matches.
    pub fn unregister(&mut self, req: &UnregisterRequest) -> Result<Vec<WorkerId>, HubError> {
        let tenant = req
            .tenant_id
            .as_deref()
            .filter(|t| !t.is_empty())
            .unwrap_or(DEFAULT_TENANT);
        let targets: Vec<WorkerId> = self
            .workers()
            .filter(|w| {
                w.source.is_none()
                    && w.reg.instance_id == req.instance_id
                    && w.reg.model_name == req.model_name
                    && w.tenant() == tenant
                    && req.dp_rank.is_none_or(|d| d == w.dp_rank())
            })
            .map(|w| w.id)
            .collect();
        if targets.is_empty() {
            return Err(HubError::NotFound(format!(
                "no worker {:?} of model {:?} (tenant {tenant:?}){}",
                req.instance_id,
                req.model_name,
                req.dp_rank
                    .map(|d| format!(" with dp_rank {d}"))
                    .unwrap_or_default()
            )));
        }
        for &id in &targets {
            let derived: Vec<WorkerId> = self
                .workers()
                .filter(|w| w.source == Some(id))
                .map(|w| w.id)
                .collect();
            for d in derived {
                self.remove_worker(d);
            }
            self.remove_worker(id);
        }
        Ok(targets)
    }

    /// Removes a worker with everything it owns: blocks, pages, learned aliases.
    pub(crate) fn remove_worker(&mut self, id: WorkerId) {
        let Some(info) = self.workers.get_mut(id.0 as usize).and_then(Option::take) else {
            return;
        };
        self.changes.clear();
        self.index.remove_worker(id, &mut self.changes);
        self.flush_changes();
        self.chunkers.remove(&id);
        self.forget_learned_aliases(id);
        if info.source.is_some() {
            self.derived -= 1;
        }
        self.feed.push_op(Op::WorkerGone { id });
        self.by_name
            .remove(&(info.reg.instance_id.clone(), info.dp_rank()));
        let model = ModelKey::new(info.tenant(), &info.reg.model_name);
        if let Some(n) = self.model_workers.get_mut(&model) {
            *n -= 1;
            if *n == 0 {
                self.model_workers.remove(&model);
                self.sizes.remove(&model);
                self.aliases
                    .retain(|(t, _), a| !(t == &model.tenant && a.model == model.model));
            }
        }
    }

    fn forget_learned_aliases(&mut self, owner: WorkerId) {
        if self.learned.remove(&owner).is_some() {
            self.aliases.retain(|_, a| a.owner != Some(owner));
        }
    }

    /// The worker a batch from `source`'s publisher belongs to: the batch's dp rank overrides
    /// the registered one, naming (and creating, from the source's registration) a sibling.
    ///
    /// # Errors
    /// `Some(limit)` when a new sibling would pass a cap, `None` when `source` is gone.
    pub fn resolve(
        &mut self,
        source: WorkerId,
        dp_rank: Option<u32>,
    ) -> Result<WorkerId, Option<Limit>> {
        let info = self.worker(source).ok_or(None)?;
        let dp = match dp_rank {
            Some(d) if d != info.dp_rank() => d,
            _ => return Ok(source),
        };
        if let Some(&id) = self.by_name.get(&(info.reg.instance_id.clone(), dp)) {
            return Ok(id);
        }
        let siblings = self.workers().filter(|w| w.source == Some(source)).count();
        if siblings >= self.config.limits.dp_ranks_per_worker {
            return Err(Some(Limit::DpRanksPerWorker));
        }
        if self.derived >= self.config.limits.dp_workers {
            return Err(Some(Limit::DpWorkers));
        }
        let mut reg = info.reg.clone();
        reg.dp_rank = Some(dp);
        let (connected, stream) = (info.status.connected, info.status.event_stream);
        let id = self
            .insert_worker(reg, Some(source))
            .map_err(|_| Some(Limit::DpWorkers))?;
        // Named by a batch of its source's stream: it shares that stream's state.
        if let Some(w) = self.worker_mut(id) {
            w.status.connected = connected;
            w.status.event_stream = stream;
        }
        Ok(id)
    }

    /// Forgets what `source`'s publisher told (engine restart, or disconnected too long): the
    /// blocks and pages of its workers, the siblings its dp ranks named, the aliases its
    /// events taught. Returns the blocks dropped.
    pub fn clear_blocks(&mut self, source: WorkerId) -> u64 {
        let mut n = 0;
        for id in self.family(source) {
            n += self.index.worker_blocks(id) as u64;
            if id == source {
                self.changes.clear();
                self.index.clear_worker(id, &mut self.changes);
                self.flush_changes();
                self.chunkers.remove(&id);
                self.forget_learned_aliases(id);
            } else {
                self.remove_worker(id);
            }
        }
        n
    }

    /// Records the publisher's connection state; the feed hears of it when routability
    /// changes. A reconnect clears an expired stream.
    pub fn set_connected(&mut self, source: WorkerId, connected: bool) {
        self.update_status(source, |s| {
            s.connected = connected;
            if connected {
                s.event_stream = EventStream::Connected;
                s.stream_expired = false;
            } else if s.event_stream == EventStream::Connected {
                s.event_stream = EventStream::Dropped;
            }
        });
    }

    /// Marks `source`'s stream as dropped for longer than `keep_disconnected`: its workers
    /// stop being routing candidates until it reconnects.
    pub fn set_stream_expired(&mut self, source: WorkerId) {
        self.update_status(source, |s| {
            s.stream_expired = s.event_stream == EventStream::Dropped;
        });
    }

    /// Records whether `worker`'s engine metrics have been failing past the down limit.
    pub fn set_metrics_down(&mut self, worker: WorkerId, down: bool) {
        self.update_worker_status(worker, |s| s.metrics_down = down);
    }

    /// Applies `f` to the status of `source`'s family (see [`Hub::update_worker_status`]).
    fn update_status(&mut self, source: WorkerId, f: impl Fn(&mut WorkerStatus)) {
        for id in self.family(source) {
            self.update_worker_status(id, &f);
        }
    }

    /// Applies `f` to `worker`'s status and tells the feed when its routability changed.
    fn update_worker_status(&mut self, worker: WorkerId, f: impl Fn(&mut WorkerStatus)) {
        let Some(w) = self.worker_mut(worker) else {
            return;
        };
        let was = w.status.is_routable();
        f(&mut w.status);
        if was != w.status.is_routable() {
            let op = worker_op(w);
            self.feed.push_op(op);
        }
    }
}

fn same_but_dp(a: &RegisterRequest, b: &RegisterRequest) -> bool {
    a.instance_id == b.instance_id
        && a.model_name == b.model_name
        && a.tenant_id == b.tenant_id
        && a.block_size == b.block_size
        && a.address == b.address
}

pub(crate) fn check_name(field: &str, v: &str, may_be_empty: bool) -> Result<(), HubError> {
    if !may_be_empty && v.trim().is_empty() {
        return Err(HubError::BadRequest(format!("{field} must not be empty")));
    }
    if v.len() > MAX_NAME_BYTES {
        return Err(HubError::BadRequest(format!(
            "{field} is longer than {MAX_NAME_BYTES} bytes"
        )));
    }
    Ok(())
}

/// The host of a `tcp://host:port` endpoint the collector can connect to.
fn endpoint_host(endpoint: &str) -> Result<&str, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or("must be tcp://host:port")?;
    let (host, port) = rest.rsplit_once(':').ok_or("must be tcp://host:port")?;
    port.parse::<u16>()
        .map_err(|_| format!("port {port:?} is not a number"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host == "*" {
        return Err(
            "must name a host to connect to (the collector connects; the engine binds)".into(),
        );
    }
    Ok(host)
}
