//! Contexts, foreign functions, and the helpers cpp-host links for emscripten modules.

use crate::abi::status;
use crate::hostcalls::memory::{copy_out, read_or};
use crate::hostcalls::register::{hostcall, Imports};

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    hostcall!(l, "proxy_set_effective_context", |c, id: i32| {
        let s = c.data_mut();
        let id = id as u32;
        if id != s.root_id && !s.contexts.contains_key(&id) {
            return Ok(status::BAD_ARGUMENT);
        }
        s.effective = id;
        Ok(status::OK)
    })?;
    hostcall!(l, "proxy_done", |c| Ok(status::OK))?;
    hostcall!(
        l,
        "proxy_call_foreign_function",
        |c, nptr: i32, nlen: i32, aptr: i32, alen: i32, ptr_ptr: i32, size_ptr: i32| {
            let name = String::from_utf8_lossy(&read_or!(&mut c, nptr, nlen)).into_owned();
            let args = read_or!(&mut c, aptr, alen);
            let result = {
                let mut inner = c.data().shared.lock();
                inner.foreign_calls.push((name.clone(), args.clone()));
                match inner.foreign.get_mut(&name) {
                    Some(f) => f(&args),
                    None => return Ok(status::NOT_FOUND),
                }
            };
            match result {
                Ok(bytes) => copy_out(&mut c, &bytes, ptr_ptr, size_ptr),
                Err(st) => Ok(st as i32),
            }
        }
    )?;
    // Linked by cpp-host for emscripten-built modules.
    hostcall!(l, "pthread_equal", always, |_, a: i32, b: i32| -> i32 {
        (a == b) as i32
    })?;
    hostcall!(l, "emscripten_notify_memory_growth", always, |_, _: i32| {})?;
    Ok(())
}
