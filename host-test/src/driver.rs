//! The stream driver: moves each request through the filter's callbacks the way Envoy's
//! filter manager does (pauses, continues, buffering, local replies, resets), then retires it.

use crate::gateway::{Gateway, UpstreamRequest, MAX_FINISHED_REQUESTS};
use crate::headers::Headers;
use crate::model::{Abi, Deferred, StreamEvent};
use crate::stream::{Dir, Flow, Phase, Property, RequestSpec, Side, Stream};
use crate::types::{HostError, LocalResponse, RequestId, Response, StreamState};

impl Gateway {
    /// Answers a request held with [`RequestBuilder::hold_response`] once it reached the
    /// upstream. Returns false if it is not waiting for a response.
    pub fn respond(&mut self, id: RequestId, response: Response) -> bool {
        match self.streams.get_mut(&id) {
            Some(st) if st.phase == Phase::AwaitingResponse => {
                st.canned_response = Some(response);
                st.hold_response = false;
                self.dirty.insert(id);
            }
            _ => return false,
        }
        self.settle();
        true
    }

    /// Resets a stream from the client side (Envoy: downstream reset): `on_log`, `on_done`,
    /// `on_delete` run and pending callouts of the stream are cancelled.
    pub fn reset(&mut self, id: RequestId) {
        if let Some(st) = self.streams.get_mut(&id) {
            if st.phase != Phase::Done {
                st.reset = true;
                self.dirty.insert(id);
            }
        }
        self.settle();
    }

    pub(crate) fn start_request(&mut self, spec: RequestSpec) -> RequestId {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let worker = spec.worker.unwrap_or_else(|| {
            let w = self.next_worker % self.vms.len();
            self.next_worker += 1;
            w
        });
        let mut st = Stream {
            worker,
            ctx: 0,
            phase: Phase::Request,
            state: StreamState::RequestPaused,
            req: Dir::new(spec.headers, spec.body, spec.trailers),
            resp: Dir::default(),
            hold_response: spec.hold_response,
            canned_response: spec.response,
            local: None,
            response_override: None,
            reset: false,
            fuel: 0,
            final_response: None,
            override_host: None,
            properties: Vec::new(),
        };
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            st.phase = Phase::Done;
            st.state = StreamState::Failed(HostError::VmFailed(worker));
            self.streams.insert(id, st);
            self.retire(id);
            return id;
        };
        let created = vm.create_http_context(spec.properties);
        let ctx = match &created {
            Ok((ctx, _)) | Err((ctx, _)) => *ctx,
        };
        st.ctx = ctx;
        self.by_ctx.insert((worker, ctx), id);
        self.streams.insert(id, st);
        self.dirty.insert(id);
        match created {
            Ok((_, fuel)) => self.account(worker, ctx, fuel),
            Err((_, e)) => {
                self.fail_vm(worker, e);
                return id;
            }
        }
        self.settle();
        id
    }

    pub(crate) fn account(&mut self, worker: usize, ctx: u32, fuel: u64) {
        self.fuel_total += fuel;
        if let Some(id) = self.by_ctx.get(&(worker, ctx)) {
            if let Some(st) = self.streams.get_mut(id) {
                st.fuel += fuel;
            }
        }
    }

    /// Applies a VM's effects queued during its last call. `current`: the stream and side whose
    /// callback just ran (a continue during it turns its Pause into Continue, as Envoy's
    /// after-call action does).
    pub(crate) fn apply_deferred(&mut self, worker: usize, current: Option<(RequestId, Side)>) {
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            return;
        };
        let deferred = std::mem::take(&mut vm.store.data_mut().deferred);
        // Override host and properties are read back into the stream after every call.
        let snapshots: Vec<(u32, Option<Vec<u8>>, Vec<Property>)> = vm
            .store
            .data()
            .contexts
            .iter()
            .map(|(id, c)| (*id, c.override_host.clone(), c.set_properties.clone()))
            .collect();
        for (ctx, host, props) in snapshots {
            if let Some(st) = self
                .by_ctx
                .get(&(worker, ctx))
                .and_then(|id| self.streams.get_mut(id))
            {
                st.override_host = host.map(|h| String::from_utf8_lossy(&h).into_owned());
                st.properties = props;
            }
        }
        for d in deferred {
            let ctx = match &d {
                Deferred::Continue { context, .. }
                | Deferred::Close { context, .. }
                | Deferred::Local { context, .. } => *context,
            };
            let Some(&id) = self.by_ctx.get(&(worker, ctx)) else {
                continue;
            };
            let Some(st) = self.streams.get_mut(&id) else {
                continue;
            };
            if st.phase == Phase::Done {
                continue;
            }
            match d {
                Deferred::Continue { stream, .. } => {
                    let side = if stream == crate::abi::stream::REQUEST {
                        Side::Request
                    } else {
                        Side::Response
                    };
                    let in_callback = current == Some((id, side));
                    let phase_ok = match side {
                        Side::Request => st.phase == Phase::Request,
                        Side::Response => st.phase == Phase::Response,
                    };
                    let dir = st.dir(side);
                    if phase_ok && (dir.held || in_callback) {
                        dir.resume = true;
                        self.dirty.insert(id);
                    }
                }
                Deferred::Close { .. } => {
                    st.reset = true;
                    self.dirty.insert(id);
                }
                Deferred::Local { response, .. } => self.local_reply(id, response),
            }
        }
    }

    pub(crate) fn local_reply(&mut self, id: RequestId, local: LocalResponse) {
        let Some(st) = self.streams.get_mut(&id) else {
            return;
        };
        if st.local.is_some() && st.phase == Phase::Response {
            return;
        }
        let mut response = Response::new(local.status);
        if !local.body.is_empty() {
            response
                .headers
                .add("content-length", &local.body.len().to_string());
            response.headers.add("content-type", "text/plain");
        }
        for (k, v) in local.headers.iter_bytes() {
            response.headers.set_bytes(k, v);
        }
        response.body = local.body.clone();
        st.local = Some(local);
        self.dirty.insert(id);
        match st.phase {
            // The request is abandoned; the reply goes through the response callbacks.
            Phase::Request | Phase::AwaitingResponse => {
                st.phase = Phase::Response;
                st.resp = Dir::new(response.headers_with_status(), vec![response.body], None);
            }
            Phase::Response => st.response_override = Some(response),
            Phase::Done => {}
        }
    }

    pub(crate) fn drive(&mut self, id: RequestId) {
        loop {
            let Some(st) = self.streams.get_mut(&id) else {
                return;
            };
            if st.phase == Phase::Done {
                return;
            }
            if st.reset {
                self.finish(id, StreamState::Reset);
                return;
            }
            match st.phase {
                Phase::Request => match self.pump(id, Side::Request) {
                    Err(()) => return,
                    Ok(Flow::Waiting) => {
                        self.set_state(id, StreamState::RequestPaused);
                        return;
                    }
                    Ok(Flow::Complete) => {
                        let st = self.streams.get_mut(&id).expect("stream");
                        if st.phase == Phase::Request {
                            st.phase = Phase::AwaitingResponse;
                        }
                    }
                    Ok(Flow::Ended) => {}
                },
                Phase::AwaitingResponse => {
                    if st.hold_response && st.canned_response.is_none() {
                        self.set_state(id, StreamState::AwaitingResponse);
                        return;
                    }
                    let response = match st.canned_response.take() {
                        Some(r) => r,
                        None => {
                            let req = UpstreamRequest {
                                worker: st.worker,
                                headers: st.req.out_headers.clone().unwrap_or_default(),
                                body: st.req.out_body.clone(),
                                trailers: st.req.out_trailers.clone(),
                            };
                            (self.upstream)(&req)
                        }
                    };
                    let st = self.streams.get_mut(&id).expect("stream");
                    st.resp = Dir::new(
                        response.headers_with_status(),
                        vec![response.body],
                        response.trailers,
                    );
                    st.phase = Phase::Response;
                }
                Phase::Response => match self.pump(id, Side::Response) {
                    Err(()) => return,
                    Ok(Flow::Waiting) => {
                        self.set_state(id, StreamState::ResponsePaused);
                        return;
                    }
                    Ok(Flow::Complete) | Ok(Flow::Ended) => {
                        let st = self.streams.get_mut(&id).expect("stream");
                        if st.reset {
                            continue;
                        }
                        let response = match st.response_override.take() {
                            Some(r) => r,
                            None => {
                                let mut headers = st.resp.out_headers.clone().unwrap_or_default();
                                let status = headers
                                    .get(":status")
                                    .and_then(|s| s.parse().ok())
                                    .unwrap_or(200);
                                headers.remove(":status");
                                Response {
                                    status,
                                    headers,
                                    body: st.resp.out_body.clone(),
                                    trailers: st.resp.out_trailers.clone(),
                                }
                            }
                        };
                        st.final_response = Some(response);
                        self.finish(id, StreamState::Complete);
                        return;
                    }
                },
                Phase::Done => return,
            }
        }
    }

    pub(crate) fn set_state(&mut self, id: RequestId, state: StreamState) {
        if let Some(st) = self.streams.get_mut(&id) {
            st.state = state;
        }
    }

    /// Runs the callbacks of one direction as far as they go. `Err(())`: the VM trapped (the
    /// stream is already marked failed).
    pub(crate) fn pump(&mut self, id: RequestId, side: Side) -> Result<Flow, ()> {
        let passthrough = self.allow_on_headers_stop_iteration || self.abi == Abi::V0_2_100;
        loop {
            let st = self.streams.get_mut(&id).expect("stream");
            let expected = if side == Side::Request {
                Phase::Request
            } else {
                Phase::Response
            };
            if st.phase != expected || st.reset || st.response_override.is_some() {
                return Ok(Flow::Ended);
            }
            let (worker, ctx) = (st.worker, st.ctx);
            let dir = st.dir(side);
            if dir.held {
                if std::mem::take(&mut dir.resume) {
                    let was_stop_all = std::mem::take(&mut dir.stop_all);
                    self.release(id, side);
                    if was_stop_all {
                        // Envoy buffered what arrived meanwhile and hands it over as one chunk.
                        let dir = self.streams.get_mut(&id).expect("stream").dir(side);
                        let merged: Vec<u8> = dir.chunks.drain(..).flatten().collect();
                        if !merged.is_empty() {
                            dir.chunks.push_back(merged);
                        }
                    }
                    continue;
                }
                if dir.stop_all {
                    return Ok(Flow::Waiting);
                }
            }
            // The next event of this direction.
            let (event, a, b) = if !dir.headers_delivered {
                dir.headers_delivered = true;
                let headers = dir.headers.take().unwrap_or_default();
                let n = headers.len() as i32;
                let eos = dir.end_of_stream() as i32;
                let vm = self.vms[worker].as_mut().expect("live vm");
                let c = vm.store.data_mut().contexts.get_mut(&ctx).expect("context");
                match side {
                    Side::Request => c.request_headers = Some(headers),
                    Side::Response => c.response_headers = Some(headers),
                }
                let event = if side == Side::Request {
                    StreamEvent::RequestHeaders
                } else {
                    StreamEvent::ResponseHeaders
                };
                (event, n, eos)
            } else if let Some(chunk) = dir.chunks.pop_front() {
                let eos = dir.end_of_stream() as i32;
                let vm = self.vms[worker].as_mut().expect("live vm");
                let c = vm.store.data_mut().contexts.get_mut(&ctx).expect("context");
                let body = match side {
                    Side::Request => &mut c.request_body,
                    Side::Response => &mut c.response_body,
                };
                body.extend_from_slice(&chunk);
                let event = if side == Side::Request {
                    StreamEvent::RequestBody
                } else {
                    StreamEvent::ResponseBody
                };
                (event, body.len() as i32, eos)
            } else if dir.trailers.is_some() && !dir.trailers_delivered {
                dir.trailers_delivered = true;
                let trailers = dir.trailers.clone().unwrap_or_default();
                let n = trailers.len() as i32;
                let vm = self.vms[worker].as_mut().expect("live vm");
                let c = vm.store.data_mut().contexts.get_mut(&ctx).expect("context");
                match side {
                    Side::Request => c.request_trailers = Some(trailers),
                    Side::Response => c.response_trailers = Some(trailers),
                }
                let event = if side == Side::Request {
                    StreamEvent::RequestTrailers
                } else {
                    StreamEvent::ResponseTrailers
                };
                (event, n, 0)
            } else if dir.held {
                return Ok(Flow::Waiting);
            } else {
                self.release(id, side);
                return Ok(Flow::Complete);
            };

            let vm = self.vms[worker].as_mut().expect("live vm");
            let result = vm.on_stream_event(event, ctx, a, b);
            let called = match result {
                Ok(c) => c,
                Err(e) => {
                    self.fail_vm(worker, e);
                    return Err(());
                }
            };
            self.account(worker, ctx, called.fuel);
            self.apply_deferred(worker, Some((id, side)));
            let st = self.streams.get_mut(&id).expect("stream");
            if st.phase != expected || st.reset || st.response_override.is_some() {
                return Ok(Flow::Ended);
            }
            let dir = st.dir(side);
            let resumed = std::mem::take(&mut dir.resume);
            if called.value == 0 || resumed {
                self.release(id, side);
                continue;
            }
            dir.held = true;
            match event {
                StreamEvent::RequestHeaders | StreamEvent::ResponseHeaders => {
                    dir.stop_all = !passthrough
                }
                StreamEvent::RequestBody => {
                    // StopIterationAndBuffer: Envoy's request buffer limit answers 413.
                    let vm = self.vms[worker].as_ref().expect("live vm");
                    let buffered = vm
                        .store
                        .data()
                        .contexts
                        .get(&ctx)
                        .map_or(0, |c| c.request_body.len());
                    if buffered > self.buffer_limit_bytes {
                        self.local_reply(
                            id,
                            LocalResponse {
                                status: 413,
                                details: "request_payload_too_large".into(),
                                headers: Headers::new(),
                                body: b"Payload Too Large".to_vec(),
                                grpc_status: -1,
                                from_filter: false,
                            },
                        );
                        return Ok(Flow::Ended);
                    }
                }
                _ => {}
            }
        }
    }

    /// Everything the filter held in this direction goes on (upstream or to the client).
    pub(crate) fn release(&mut self, id: RequestId, side: Side) {
        let st = self.streams.get_mut(&id).expect("stream");
        let (worker, ctx) = (st.worker, st.ctx);
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            return;
        };
        let Some(c) = vm.store.data_mut().contexts.get_mut(&ctx) else {
            return;
        };
        let (headers, body, trailers) = match side {
            Side::Request => (&c.request_headers, &mut c.request_body, &c.request_trailers),
            Side::Response => (
                &c.response_headers,
                &mut c.response_body,
                &c.response_trailers,
            ),
        };
        let dir = st.dir(side);
        dir.held = false;
        if dir.out_headers.is_none() {
            dir.out_headers = Some(headers.clone().unwrap_or_default());
        }
        dir.out_body.append(body);
        if dir.trailers_delivered && dir.out_trailers.is_none() {
            dir.out_trailers = trailers.clone();
        }
    }

    /// Keeps a finished stream for [`Gateway::outcome`], forgetting the oldest past the bound.
    pub(crate) fn retire(&mut self, id: RequestId) {
        self.dirty.remove(&id);
        self.finished.push_back(id);
        while self.finished.len() > MAX_FINISHED_REQUESTS {
            if let Some(old) = self.finished.pop_front() {
                self.streams.remove(&old);
            }
        }
    }

    pub(crate) fn finish(&mut self, id: RequestId, state: StreamState) {
        let st = self.streams.get_mut(&id).expect("stream");
        st.phase = Phase::Done;
        st.state = state;
        let (worker, ctx) = (st.worker, st.ctx);
        self.retire(id);
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            return;
        };
        let result = vm.end_context(ctx);
        match result {
            Ok(fuel) => {
                self.account(worker, ctx, fuel);
                self.apply_deferred(worker, None);
                self.by_ctx.remove(&(worker, ctx));
            }
            Err(e) => self.fail_vm(worker, e),
        }
    }
}
