//! The host functions a module imports, grouped by ABI area. Each area's `link` registers its
//! imports through [`register::Imports`] and the `hostcall!` macro, so every import name is
//! written once.
//!
//! Hostcalls run against the *effective context* (the context of the current callback, or
//! the one `proxy_set_effective_context` chose). Effects Envoy applies only after the VM call
//! returns (`proxy_continue_stream`, `proxy_send_local_response`, `proxy_close_stream`: Envoy
//! queues them with `addAfterVmCallAction`) are queued as [`crate::model::Deferred`] and
//! applied by the gateway's driver.

use wasmtime::Linker;

use crate::abi;
use crate::model::Mode;
use crate::state::HostState;

mod buffers;
mod callouts;
mod contexts;
mod higress;
mod logging;
mod maps;
mod memory;
mod metrics;
mod properties;
mod register;
mod shared_data;
mod streams;
mod wasi;

/// Links every import Envoy (and in Higress mode, Higress) offers a module of ABI 0.2.1.
pub(crate) fn link(linker: &mut Linker<HostState>, mode: Mode) -> wasmtime::Result<()> {
    let mut env = register::Imports::new(linker, "env");
    logging::link(&mut env)?;
    buffers::link(&mut env)?;
    maps::link(&mut env)?;
    properties::link(&mut env)?;
    shared_data::link(&mut env)?;
    metrics::link(&mut env)?;
    streams::link(&mut env)?;
    callouts::link(&mut env)?;
    contexts::link(&mut env)?;
    if mode == Mode::Higress {
        higress::link(&mut env)?;
    }
    for module in abi::WASI_MODULES {
        wasi::link(&mut register::Imports::new(linker, module))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;

    use wasmtime::{Engine, Linker, Store};

    use super::*;
    use crate::model::HostOptions;
    use crate::shared::Shared;

    /// The linked imports, as `module.name`.
    fn linked(mode: Mode) -> BTreeSet<String> {
        let engine = Engine::default();
        let mut linker = Linker::new(&engine);
        link(&mut linker, mode).expect("every name is linked once");
        let opts = HostOptions {
            mode,
            vm_id: String::new(),
            root_id: String::new(),
            plugin_name: String::new(),
            plugin_config: Vec::new(),
            vm_config: Vec::new(),
            env: Vec::new(),
            fuel: false,
            fuel_per_call: 0,
        };
        let mut store = Store::new(
            &engine,
            HostState::new(Arc::new(opts), Shared::default(), 0),
        );
        linker
            .iter(&mut store)
            .map(|(m, n, _)| format!("{m}.{n}"))
            .collect()
    }

    /// What `check_imports` accepts, as `module.name`.
    fn declared(mode: Mode) -> BTreeSet<String> {
        let mut env: Vec<&str> = abi::ENV_IMPORTS.to_vec();
        if mode == Mode::Higress {
            env.extend(abi::HIGRESS_IMPORTS);
        }
        let wasi = abi::WASI_MODULES
            .iter()
            .flat_map(|m| abi::WASI_IMPORTS.iter().map(move |n| format!("{m}.{n}")));
        env.iter().map(|n| format!("env.{n}")).chain(wasi).collect()
    }

    #[test]
    fn links_exactly_the_imports_the_loader_accepts() {
        for mode in [Mode::Envoy, Mode::Higress] {
            assert_eq!(linked(mode), declared(mode), "{mode:?}");
        }
    }
}
