//! One VM: a wasmtime store and instance of the module, the checks a module passes before
//! it is instantiated, and typed handles on the callbacks it exports.

use std::collections::HashMap;
use std::sync::Arc;

use wasmtime::{Extern, Instance, Linker, Module, Store, TypedFunc};

use crate::abi::{self, status};
use crate::model::{Abi, CallResponse, HostOptions, HttpCtx, Mode, StreamEvent};
use crate::shared::Shared;
use crate::state::HostState;
use crate::types::HostError;

/// Refuses imports the host does not link, naming the first one, as Envoy's V8 loader does.
pub(crate) fn check_imports(module: &Module, mode: Mode) -> Result<(), HostError> {
    for import in module.imports() {
        let (m, n) = (import.module(), import.name());
        let known = match m {
            "env" => {
                abi::ENV_IMPORTS.contains(&n)
                    || (mode == Mode::Higress && abi::HIGRESS_IMPORTS.contains(&n))
            }
            _ if abi::WASI_MODULES.contains(&m) => abi::WASI_IMPORTS.contains(&n),
            _ => false,
        };
        if !known {
            return Err(HostError::UnknownImport {
                module: m.to_string(),
                name: n.to_string(),
            });
        }
    }
    Ok(())
}

/// ABI version the module declares; `Err` if none the host (in this mode) knows.
pub(crate) fn check_abi(module: &Module, mode: Mode) -> Result<Abi, HostError> {
    let exports: Vec<&str> = module.exports().map(|e| e.name()).collect();
    let has = |n: &str| exports.contains(&n);
    if has("proxy_abi_version_0_2_1") || has("proxy_abi_version_0_2_0") {
        // Higress prefers its own marker when both are exported.
        if mode == Mode::Higress && has("proxy_abi_version_0_2_100") {
            return Ok(Abi::V0_2_100);
        }
        return Ok(Abi::V0_2_1);
    }
    if mode == Mode::Higress && has("proxy_abi_version_0_2_100") {
        return Ok(Abi::V0_2_100);
    }
    Err(HostError::UnknownAbi)
}

type F1 = TypedFunc<i32, ()>;
type F2 = TypedFunc<(i32, i32), ()>;
type F2R = TypedFunc<(i32, i32), i32>;
type F3R = TypedFunc<(i32, i32, i32), i32>;
type F5 = TypedFunc<(i32, i32, i32, i32, i32), ()>;

#[derive(Default)]
struct Exports {
    initialize: Option<TypedFunc<(), ()>>,
    main: Option<TypedFunc<(i32, i32), i32>>,
    start: Option<TypedFunc<(), ()>>,
    on_context_create: Option<F2>,
    on_vm_start: Option<F2R>,
    on_configure: Option<F2R>,
    on_tick: Option<F1>,
    on_queue_ready: Option<F2>,
    on_request_headers: Option<F3R>,
    on_request_body: Option<F3R>,
    on_request_trailers: Option<F2R>,
    on_response_headers: Option<F3R>,
    on_response_body: Option<F3R>,
    on_response_trailers: Option<F2R>,
    on_http_call_response: Option<F5>,
    on_foreign_function: Option<TypedFunc<(i32, i32, i32), ()>>,
    on_done: Option<TypedFunc<i32, i32>>,
    on_log: Option<F1>,
    on_delete: Option<F1>,
}

/// What one VM call returned, and the fuel it burnt.
pub(crate) struct Called<T> {
    pub value: T,
    pub fuel: u64,
}

pub(crate) struct Vm {
    pub store: Store<HostState>,
    exports: Exports,
    next_context: u32,
}

fn typed<P: wasmtime::WasmParams, Rs: wasmtime::WasmResults>(
    store: &mut Store<HostState>,
    instance: &Instance,
    name: &str,
) -> Result<Option<TypedFunc<P, Rs>>, HostError> {
    match instance.get_export(&mut *store, name) {
        Some(Extern::Func(f)) => f.typed::<P, Rs>(&*store).map(Some).map_err(|e| {
            HostError::Instantiate(format!("export {name} has the wrong signature: {e}"))
        }),
        _ => Ok(None),
    }
}

impl Vm {
    /// Instantiates the module and runs Envoy's start sequence: `_initialize` (then `main`),
    /// root context creation, `proxy_on_vm_start`, `proxy_on_configure`.
    pub fn start(
        module: &Module,
        linker: &Linker<HostState>,
        opts: Arc<HostOptions>,
        shared: Shared,
        worker: usize,
    ) -> Result<Vm, HostError> {
        let state = HostState::new(opts.clone(), shared, worker);
        let mut store = Store::new(module.engine(), state);
        if opts.fuel {
            store
                .set_fuel(opts.fuel_per_call)
                .map_err(|e| HostError::Instantiate(e.to_string()))?;
        }
        let instance = linker
            .instantiate(&mut store, module)
            .map_err(|e| HostError::Instantiate(format!("{e:?}")))?;
        let memory = instance.get_memory(&mut store, "memory");
        let mut alloc = typed::<i32, i32>(&mut store, &instance, "malloc")?;
        if alloc.is_none() {
            alloc = typed::<i32, i32>(&mut store, &instance, "proxy_on_memory_allocate")?;
        }
        if alloc.is_none() {
            return Err(HostError::Instantiate(
                "Wasm module is missing malloc function.".into(),
            ));
        }
        store.data_mut().memory = memory;
        store.data_mut().alloc = alloc;
        let s = &mut store;
        let i = &instance;
        let exports = Exports {
            initialize: typed(s, i, "_initialize")?,
            main: typed(s, i, "main")?,
            start: typed(s, i, "_start")?,
            on_context_create: typed(s, i, "proxy_on_context_create")?,
            on_vm_start: typed(s, i, "proxy_on_vm_start")?,
            on_configure: typed(s, i, "proxy_on_configure")?,
            on_tick: typed(s, i, "proxy_on_tick")?,
            on_queue_ready: typed(s, i, "proxy_on_queue_ready")?,
            on_request_headers: typed(s, i, "proxy_on_request_headers")?,
            on_request_body: typed(s, i, "proxy_on_request_body")?,
            on_request_trailers: typed(s, i, "proxy_on_request_trailers")?,
            on_response_headers: typed(s, i, "proxy_on_response_headers")?,
            on_response_body: typed(s, i, "proxy_on_response_body")?,
            on_response_trailers: typed(s, i, "proxy_on_response_trailers")?,
            on_http_call_response: typed(s, i, "proxy_on_http_call_response")?,
            on_foreign_function: typed(s, i, "proxy_on_foreign_function")?,
            on_done: typed(s, i, "proxy_on_done")?,
            on_log: typed(s, i, "proxy_on_log")?,
            on_delete: typed(s, i, "proxy_on_delete")?,
        };
        let mut vm = Vm {
            store,
            exports,
            next_context: 2,
        };
        vm.store.data_mut().restricted = true;
        let init = if let Some(f) = vm.exports.initialize.clone() {
            let r = vm.call("_initialize", 0, |s| f.call(s, ()));
            match (r, vm.exports.main.clone()) {
                (Ok(_), Some(main)) => vm.call("main", 0, |s| main.call(s, (0, 0))).map(|_| ()),
                (r, _) => r.map(|_| ()),
            }
        } else if let Some(f) = vm.exports.start.clone() {
            vm.call("_start", 0, |s| f.call(s, ())).map(|_| ())
        } else {
            Ok(())
        };
        vm.store.data_mut().restricted = false;
        init?;
        let root = vm.store.data().root_id as i32;
        if let Some(f) = vm.exports.on_context_create.clone() {
            vm.call("proxy_on_context_create", root as u32, |s| {
                f.call(s, (root, 0))
            })?;
        }
        if let Some(f) = vm.exports.on_vm_start.clone() {
            let n = opts.vm_config.len() as i32;
            if vm
                .call("proxy_on_vm_start", root as u32, |s| f.call(s, (root, n)))?
                .value
                == 0
            {
                return Err(HostError::VmStartFailed);
            }
        }
        if let Some(f) = vm.exports.on_configure.clone() {
            let n = opts.plugin_config.len() as i32;
            if vm
                .call("proxy_on_configure", root as u32, |s| f.call(s, (root, n)))?
                .value
                == 0
            {
                return Err(HostError::ConfigurationRejected);
            }
        }
        Ok(vm)
    }

    /// Runs one export with `effective` as the effective context, measuring fuel.
    fn call<T>(
        &mut self,
        name: &str,
        effective: u32,
        f: impl FnOnce(&mut Store<HostState>) -> wasmtime::Result<T>,
    ) -> Result<Called<T>, HostError> {
        let fuel_on = self.store.data().opts.fuel;
        let budget = self.store.data().opts.fuel_per_call;
        if fuel_on {
            let _ = self.store.set_fuel(budget);
        }
        self.store.data_mut().effective = effective;
        self.store.data_mut().last_critical = None;
        let result = f(&mut self.store);
        let fuel = if fuel_on {
            budget - self.store.get_fuel().unwrap_or(budget)
        } else {
            0
        };
        match result {
            Ok(value) => Ok(Called { value, fuel }),
            Err(e) => {
                let mut message = format!("{e:?}");
                if let Some(panic) = self.store.data_mut().last_critical.take() {
                    message = format!("{panic}\n{message}");
                }
                Err(HostError::Trap {
                    callback: name.to_string(),
                    message,
                })
            }
        }
    }

    pub fn root_id(&self) -> u32 {
        self.store.data().root_id
    }

    /// Creates an HTTP context (`proxy_on_context_create(id, root)`).
    pub fn create_http_context(
        &mut self,
        given: HashMap<Vec<String>, Vec<u8>>,
    ) -> Result<(u32, u64), (u32, HostError)> {
        let id = self.next_context;
        self.next_context += 1;
        self.store.data_mut().contexts.insert(
            id,
            HttpCtx {
                given_properties: given,
                ..HttpCtx::default()
            },
        );
        let root = self.root_id() as i32;
        match self.exports.on_context_create.clone() {
            Some(f) => self
                .call("proxy_on_context_create", id, |s| {
                    f.call(s, (id as i32, root))
                })
                .map(|c| (id, c.fuel))
                .map_err(|e| (id, e)),
            None => Ok((id, 0)),
        }
    }

    /// A header/body/trailer callback; a missing export means `Continue`.
    pub fn on_stream_event(
        &mut self,
        event: StreamEvent,
        ctx: u32,
        a: i32,
        b: i32,
    ) -> Result<Called<i32>, HostError> {
        let ctx_i = ctx as i32;
        let e = &self.exports;
        let (name, f3, f2) = match event {
            StreamEvent::RequestHeaders => (
                "proxy_on_request_headers",
                e.on_request_headers.clone(),
                None,
            ),
            StreamEvent::RequestBody => ("proxy_on_request_body", e.on_request_body.clone(), None),
            StreamEvent::RequestTrailers => (
                "proxy_on_request_trailers",
                None,
                e.on_request_trailers.clone(),
            ),
            StreamEvent::ResponseHeaders => (
                "proxy_on_response_headers",
                e.on_response_headers.clone(),
                None,
            ),
            StreamEvent::ResponseBody => {
                ("proxy_on_response_body", e.on_response_body.clone(), None)
            }
            StreamEvent::ResponseTrailers => (
                "proxy_on_response_trailers",
                None,
                e.on_response_trailers.clone(),
            ),
        };
        if let Some(f) = f3 {
            self.call(name, ctx, |s| f.call(s, (ctx_i, a, b)))
        } else if let Some(f) = f2 {
            self.call(name, ctx, |s| f.call(s, (ctx_i, a)))
        } else {
            Ok(Called { value: 0, fuel: 0 })
        }
    }

    /// `on_log`, `on_done`, `on_delete`, then forgets the context and cancels its callouts.
    pub fn end_context(&mut self, ctx: u32) -> Result<u64, HostError> {
        let c = ctx as i32;
        let mut fuel = 0;
        let mut result = Ok(());
        if let Some(f) = self.exports.on_log.clone() {
            result = self
                .call("proxy_on_log", ctx, |s| f.call(s, c))
                .map(|r| fuel += r.fuel);
        }
        if result.is_ok() {
            if let Some(f) = self.exports.on_done.clone() {
                result = self
                    .call("proxy_on_done", ctx, |s| f.call(s, c))
                    .map(|r| fuel += r.fuel);
            }
        }
        if result.is_ok() {
            if let Some(f) = self.exports.on_delete.clone() {
                result = self
                    .call("proxy_on_delete", ctx, |s| f.call(s, c))
                    .map(|r| fuel += r.fuel);
            }
        }
        let s = self.store.data_mut();
        s.contexts.remove(&ctx);
        // Envoy cancels a context's pending callouts when the stream goes away.
        s.calls.retain(|_, call| call.callout.context_id != ctx);
        result.map(|_| fuel)
    }

    pub fn on_tick(&mut self) -> Result<u64, HostError> {
        let root = self.root_id();
        match self.exports.on_tick.clone() {
            Some(f) => self
                .call("proxy_on_tick", root, |s| f.call(s, root as i32))
                .map(|c| c.fuel),
            None => Ok(0),
        }
    }

    pub fn on_queue_ready(&mut self, root: u32, token: u32) -> Result<u64, HostError> {
        match self.exports.on_queue_ready.clone() {
            Some(f) => self
                .call("proxy_on_queue_ready", root, |s| {
                    f.call(s, (root as i32, token as i32))
                })
                .map(|c| c.fuel),
            None => Ok(0),
        }
    }

    pub fn on_foreign_function(
        &mut self,
        function_id: u32,
        args: Vec<u8>,
    ) -> Result<u64, HostError> {
        let root = self.root_id();
        let n = args.len() as i32;
        self.store.data_mut().call_data = Some(args);
        let r = match self.exports.on_foreign_function.clone() {
            Some(f) => self
                .call("proxy_on_foreign_function", root, |s| {
                    f.call(s, (root as i32, function_id as i32, n))
                })
                .map(|c| c.fuel),
            None => Ok(0),
        };
        self.store.data_mut().call_data = None;
        r
    }

    /// Delivers a callout's answer (`None`: a failure, 0 headers) to the context that made it.
    pub fn on_http_call_response(
        &mut self,
        context: u32,
        token: u32,
        response: Option<CallResponse>,
    ) -> Result<u64, HostError> {
        let (nh, nb, nt) = match &response {
            Some(r) => (
                r.headers.len() as i32,
                r.body.len() as i32,
                r.trailers.len() as i32,
            ),
            None => (0, 0, 0),
        };
        if response.is_none() {
            self.store.data_mut().status = (status::BROKEN_CONNECTION as u32, b"reset".to_vec());
        }
        self.store.data_mut().call_response = Some(response.unwrap_or_default());
        let r = match self.exports.on_http_call_response.clone() {
            Some(f) => self
                .call("proxy_on_http_call_response", context, |s| {
                    f.call(s, (context as i32, token as i32, nh, nb, nt))
                })
                .map(|c| c.fuel),
            None => Ok(0),
        };
        self.store.data_mut().call_response = None;
        r
    }
}
