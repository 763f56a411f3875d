//! The engines' subscribers: registering a worker starts its ZMQ subscriber, unregistering
//! stops it and forgets what it owned.

use std::sync::Arc;

use kvroute::event::WorkerId;

use crate::hub::{HubError, Registered};
use crate::shared::Shared;
use crate::zmq;

impl Shared {
    /// Registers a worker and starts its subscriber when it is new.
    ///
    /// # Errors
    /// See [`Hub::register`].
    pub fn register(
        self: &Arc<Self>,
        req: kvroute::api::RegisterRequest,
    ) -> Result<Registered, HubError> {
        let outcome = self.register_local(req)?;
        if let (Registered::New(id), Some(bus)) = (outcome, &self.bus) {
            // The normalized registration, so every collector derives the same worker.
            let reg = self.read().worker(id).map(|w| w.reg.clone());
            if let Some(reg) = reg {
                bus.send(
                    &self.metrics,
                    crate::bus::handle::Outgoing::Register(Box::new(reg)),
                );
            }
        }
        Ok(outcome)
    }

    /// [`Shared::register`] without telling the bus (a registration that came from it).
    ///
    /// # Errors
    /// See [`Hub::register`].
    pub(crate) fn register_local(
        self: &Arc<Self>,
        req: kvroute::api::RegisterRequest,
    ) -> Result<Registered, HubError> {
        let outcome = self.write().register(req)?;
        if let Registered::New(id) = outcome {
            self.start_subscriber(id, None);
        }
        Ok(outcome)
    }

    /// Unregisters workers and stops their subscribers.
    ///
    /// # Errors
    /// See [`Hub::unregister`].
    pub fn unregister(&self, req: &kvroute::api::UnregisterRequest) -> Result<usize, HubError> {
        let removed = self.unregister_local(req)?;
        if let Some(bus) = &self.bus {
            for (instance, dp) in &removed {
                let key = crate::bus::handle::worker_key(instance, *dp);
                bus.send(&self.metrics, crate::bus::handle::Outgoing::Unregister(key));
            }
        }
        Ok(removed.len())
    }

    /// [`Shared::unregister`] without telling the bus; returns the registrations removed.
    ///
    /// # Errors
    /// See [`Hub::unregister`].
    pub(crate) fn unregister_local(
        &self,
        req: &kvroute::api::UnregisterRequest,
    ) -> Result<Vec<(String, u32)>, HubError> {
        // Fleet first (the lock order), so no load report lands between the two removals.
        let mut fleet = self.fleet();
        let mut hub = self.write();
        // `Hub::unregister` names only the registered workers; their dp-rank siblings go too.
        let before: Vec<(WorkerId, String, u32)> = hub
            .workers()
            .map(|w| (w.id, w.reg.instance_id.clone(), w.dp_rank()))
            .collect();
        let removed = hub.unregister(req)?;
        let gone: Vec<(WorkerId, String, u32)> = before
            .into_iter()
            .filter(|(id, _, _)| hub.worker(*id).is_none())
            .collect();
        drop(hub);
        let gone_ids: Vec<WorkerId> = gone.iter().map(|(id, _, _)| *id).collect();
        fleet.forget_workers(&gone_ids);
        for (_, instance, dp) in &gone {
            self.metrics.forget_worker(instance, *dp);
        }
        drop(fleet);
        let mut subs = self.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        for id in &removed {
            if let Some(task) = subs.remove(id) {
                task.abort();
            }
        }
        Ok(gone
            .into_iter()
            .filter(|(id, _, _)| removed.contains(id))
            .map(|(_, instance, dp)| (instance, dp))
            .collect())
    }

    pub(crate) fn start_subscriber(self: &Arc<Self>, id: WorkerId, last_seq: Option<u64>) {
        // An index replica of the bus opens no engine socket: its events come from the stream.
        if self.bus.as_ref().is_some_and(|b| !b.config.role.ingests()) {
            return;
        }
        // Among several ingest processes, only the engine's owner reads it.
        if let Some(bus) = self.bus.as_ref().filter(|b| b.splits_engines()) {
            let key = self
                .read()
                .worker(id)
                .map(|w| crate::bus::handle::worker_key(&w.reg.instance_id, w.dp_rank()));
            if !key.is_some_and(|k| bus.ownership.owns(&k)) {
                return;
            }
        }
        let Some(sub) = zmq::Subscriber::new(self.clone(), id, last_seq) else {
            return;
        };
        let task = tokio::spawn(sub.run());
        if let Some(old) = self
            .subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, task)
        {
            old.abort();
        }
    }

    /// Whether `id`'s subscriber runs.
    pub fn reads(&self, id: WorkerId) -> bool {
        self.subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .is_some_and(|t| !t.is_finished())
    }

    /// How many engines this process reads (subscribers running).
    pub fn reading(&self) -> usize {
        self.read_set().len()
    }

    /// The workers whose engines this process reads (subscribers running).
    pub fn read_set(&self) -> std::collections::HashSet<WorkerId> {
        self.subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, t)| !t.is_finished())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Stops `id`'s subscriber (another process reads the engine now) and drops what it
    /// applied here: this process's index holds the engines it reads, no stale rest.
    pub(crate) fn stop_subscriber(&self, id: WorkerId) {
        if let Some(task) = self
            .subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
        {
            task.abort();
        }
        let mut hub = self.write();
        hub.set_connected(id, false);
        hub.clear_blocks(id);
        // Read again later, it starts from the stream's last batch, not from this one.
        if let Some(w) = hub.worker_mut(id) {
            w.status.last_seq = None;
        }
        drop(hub);
        self.notify();
    }

    /// Stops every subscriber.
    pub fn stop_subscribers(&self) {
        for (_, task) in self
            .subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
        {
            task.abort();
        }
    }
}
