//! Running the worker VMs outside a stream's own callbacks: starting and recreating them,
//! settling pending work, callouts (answered by their cluster, by the test, or timed out),
//! the clock and its ticks, shared-queue notifications and foreign functions.

use std::time::Duration;

use crate::gateway::Gateway;
use crate::model::CallResponse;
use crate::shared::ClusterTarget;
use crate::stream::Phase;
use crate::types::{CalloutId, CalloutReply, HostError, RequestId, Response, StreamState};
use crate::vm::Vm;

impl Gateway {
    /// Grows to `n` worker VMs (each starts and is configured like the first).
    ///
    /// # Panics
    /// If a new VM fails to start; use [`Gateway::try_workers`] to get the error.
    pub fn workers(self, n: usize) -> Self {
        match self.try_workers(n) {
            Ok(gw) => gw,
            Err(e) => panic!("starting worker VMs failed: {e}"),
        }
    }

    /// Grows to `n` worker VMs.
    ///
    /// # Errors
    /// The first VM start failure.
    pub fn try_workers(mut self, n: usize) -> Result<Self, HostError> {
        let missing = n.saturating_sub(self.vms.len());
        self.add_workers(missing)?;
        Ok(self)
    }

    pub(crate) fn add_workers(&mut self, n: usize) -> Result<(), HostError> {
        for _ in 0..n {
            let worker = self.vms.len();
            let vm = self.start_vm(worker)?;
            self.vms.push(Some(vm));
            self.settle();
        }
        Ok(())
    }

    pub(crate) fn start_vm(&self, worker: usize) -> Result<Vm, HostError> {
        Vm::start(
            &self.module,
            &self.linker,
            self.opts.clone(),
            self.shared.clone(),
            worker,
        )
    }

    /// A trap kills the VM, as in Envoy; here the failure goes to every open stream of that
    /// VM and a fresh VM takes its place (Envoy's `failure_policy: FAIL_RELOAD`).
    pub(crate) fn fail_vm(&mut self, worker: usize, error: HostError) {
        self.errors.push(error.clone());
        let victims: Vec<RequestId> = self
            .streams
            .iter()
            .filter(|(_, s)| s.worker == worker && s.phase != Phase::Done)
            .map(|(id, _)| *id)
            .collect();
        for id in victims {
            let st = self.streams.get_mut(&id).expect("stream");
            st.phase = Phase::Done;
            st.state = StreamState::Failed(error.clone());
            self.retire(id);
        }
        // A stream that was finishing fails in its own on_log/on_done: it is still mapped.
        let finishing: Vec<RequestId> = self
            .by_ctx
            .iter()
            .filter(|((w, _), _)| *w == worker)
            .map(|(_, id)| *id)
            .collect();
        for id in finishing {
            if let Some(st) = self.streams.get_mut(&id) {
                st.state = StreamState::Failed(error.clone());
            }
        }
        self.by_ctx.retain(|(w, _), _| *w != worker);
        self.vms[worker] = None;
        match self.start_vm(worker) {
            Ok(vm) => {
                self.vms[worker] = Some(vm);
                self.restarts += 1;
            }
            Err(e) => self.errors.push(e),
        }
    }

    /// Runs everything that can run: dirty streams, queue notifications, callouts a cluster
    /// answers by itself. Deterministic order.
    pub(crate) fn settle(&mut self) {
        loop {
            if let Some(id) = self.dirty.pop_first() {
                self.drive(id);
                continue;
            }
            let ready = std::mem::take(&mut self.shared.lock().queue_ready);
            if !ready.is_empty() {
                for (worker, root, token) in ready {
                    let Some(Some(vm)) = self.vms.get_mut(worker) else {
                        continue;
                    };
                    let r = vm.on_queue_ready(root, token);
                    self.fuel_total += r.as_ref().copied().unwrap_or(0);
                    match r {
                        Ok(_) => self.apply_deferred(worker, None),
                        Err(e) => self.fail_vm(worker, e),
                    }
                }
                continue;
            }
            if self.answer_one_callout() {
                continue;
            }
            break;
        }
    }

    /// Answers a pending callout and runs everything that follows. Returns false if no such
    /// callout is pending (answered, timed out, or cancelled with its stream).
    pub fn reply(&mut self, id: CalloutId, reply: CalloutReply) -> bool {
        let pending = self
            .vms
            .get(id.worker)
            .and_then(|v| v.as_ref())
            .is_some_and(|vm| vm.store.data().calls.contains_key(&id.token));
        if !pending {
            return false;
        }
        match reply {
            CalloutReply::Response(r) => self.deliver_callout(id, Some(r)),
            CalloutReply::Reset => self.deliver_callout(id, None),
            CalloutReply::NoReply => {}
        }
        self.settle();
        true
    }

    pub(crate) fn deliver_callout(&mut self, id: CalloutId, response: Option<Response>) {
        let Some(Some(vm)) = self.vms.get_mut(id.worker) else {
            return;
        };
        let Some(call) = vm.store.data_mut().calls.remove(&id.token) else {
            return;
        };
        let context = call.callout.context_id;
        let alive = context == vm.root_id() || vm.store.data().contexts.contains_key(&context);
        if !alive {
            return;
        }
        let response = response.map(|r| CallResponse {
            headers: r.headers_with_status(),
            body: r.body,
            trailers: r.trailers.unwrap_or_default(),
        });
        let result = vm.on_http_call_response(context, id.token, response);
        self.account(id.worker, context, result.as_ref().copied().unwrap_or(0));
        match result {
            Ok(_) => self.apply_deferred(id.worker, None),
            Err(e) => self.fail_vm(id.worker, e),
        }
    }

    /// Asks a cluster's handler (or forwards) for the first pending callout not asked yet.
    pub(crate) fn answer_one_callout(&mut self) -> bool {
        let mut found = None;
        'outer: for (w, vm) in self.vms.iter_mut().enumerate() {
            let Some(vm) = vm else { continue };
            for (token, call) in vm.store.data_mut().calls.iter_mut() {
                if call.consulted {
                    continue;
                }
                call.consulted = true;
                found = Some((
                    CalloutId {
                        worker: w,
                        token: *token,
                    },
                    call.callout.clone(),
                ));
                break 'outer;
            }
        }
        let Some((id, callout)) = found else {
            return false;
        };
        let reply = {
            let mut inner = self.shared.lock();
            match inner.clusters.get_mut(&callout.cluster) {
                Some(ClusterTarget::Handler(h)) => h(&callout),
                Some(ClusterTarget::Forward(addr)) => crate::http::forward(*addr, &callout),
                Some(ClusterTarget::Manual) | None => CalloutReply::NoReply,
            }
        };
        match reply {
            CalloutReply::Response(r) => self.deliver_callout(id, Some(r)),
            CalloutReply::Reset => self.deliver_callout(id, None),
            CalloutReply::NoReply => {}
        }
        true
    }

    /// Moves the test clock forward, firing due ticks (on every VM with a tick period) and
    /// callout timeouts in time order.
    pub fn advance(&mut self, by: Duration) {
        let target = self.now_nanos() + by.as_nanos() as u64;
        loop {
            let mut next: Option<u64> = None;
            for vm in self.vms.iter().flatten() {
                let s = vm.store.data();
                let times = s
                    .next_tick_nanos
                    .into_iter()
                    .chain(s.calls.values().filter_map(|c| c.deadline_nanos));
                for t in times {
                    next = Some(next.map_or(t, |n: u64| n.min(t)));
                }
            }
            let Some(t) = next.filter(|t| *t <= target) else {
                break;
            };
            self.shared.lock().now_nanos = self.now_nanos().max(t);
            for w in 0..self.vms.len() {
                let due: Vec<u32> = match &self.vms[w] {
                    Some(vm) => vm
                        .store
                        .data()
                        .calls
                        .iter()
                        .filter(|(_, c)| c.deadline_nanos.is_some_and(|d| d <= t))
                        .map(|(k, _)| *k)
                        .collect(),
                    None => continue,
                };
                for token in due {
                    // Envoy's router answers a timed-out callout itself.
                    let timeout = Response::new(504)
                        .header("content-length", "24")
                        .header("content-type", "text/plain")
                        .body("upstream request timeout");
                    self.deliver_callout(CalloutId { worker: w, token }, Some(timeout));
                }
            }
            for w in 0..self.vms.len() {
                let Some(vm) = self.vms[w].as_mut() else {
                    continue;
                };
                let s = vm.store.data_mut();
                if s.next_tick_nanos.is_some_and(|n| n <= t) {
                    s.next_tick_nanos = Some(t + s.tick_period_ms as u64 * 1_000_000);
                    let result = vm.on_tick();
                    self.fuel_total += result.as_ref().copied().unwrap_or(0);
                    match result {
                        Ok(_) => self.apply_deferred(w, None),
                        Err(e) => self.fail_vm(w, e),
                    }
                }
            }
            self.settle();
        }
        self.shared.lock().now_nanos = target;
        self.settle();
    }

    /// Enqueues onto a shared queue of this gateway's `vm_id`, as another plugin would; the
    /// owner VM gets `proxy_on_queue_ready`. Returns false if no such queue is registered.
    pub fn enqueue(&mut self, queue: &str, value: impl AsRef<[u8]>) -> bool {
        {
            let mut inner = self.shared.lock();
            let Some(token) = inner.queues.resolve(&self.opts.vm_id, queue) else {
                return false;
            };
            let q = inner
                .queues
                .by_token
                .get_mut(&token)
                .expect("resolved queue");
            q.items.push_back(value.as_ref().to_vec());
            let ready = (q.owner_vm, q.owner_root, token);
            inner.queue_ready.push(ready);
        }
        self.settle();
        true
    }

    /// Runs `proxy_on_foreign_function(root, function_id, args)` on a worker.
    ///
    /// # Errors
    /// A trap (the VM is then recreated) or a failed VM.
    pub fn call_on_foreign_function(
        &mut self,
        worker: usize,
        function_id: u32,
        args: &[u8],
    ) -> Result<(), HostError> {
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            return Err(HostError::VmFailed(worker));
        };
        let r = vm.on_foreign_function(function_id, args.to_vec());
        let out = match r {
            Ok(fuel) => {
                self.fuel_total += fuel;
                self.apply_deferred(worker, None);
                Ok(())
            }
            Err(e) => {
                self.fail_vm(worker, e.clone());
                Err(e)
            }
        };
        self.settle();
        out
    }
}
