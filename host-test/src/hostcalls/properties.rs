//! Properties: read from the stream, the test and the plugin; written as filter state.

use crate::abi::status;
use crate::hostcalls::memory::{copy_out, read_or, split_path};
use crate::hostcalls::register::{hostcall, Imports};

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    hostcall!(
        l,
        "proxy_get_property",
        |c, pptr: i32, plen: i32, ptr_ptr: i32, size_ptr: i32| {
            let path = split_path(&read_or!(&mut c, pptr, plen));
            match c.data().property(&path) {
                Some(v) => copy_out(&mut c, &v, ptr_ptr, size_ptr),
                None => Ok(status::NOT_FOUND),
            }
        }
    )?;
    hostcall!(
        l,
        "proxy_set_property",
        |c, pptr: i32, plen: i32, vptr: i32, vlen: i32| {
            let path = split_path(&read_or!(&mut c, pptr, plen));
            let value = read_or!(&mut c, vptr, vlen);
            // Envoy writes filter state of the stream; a root context has no stream.
            match c.data_mut().http() {
                Some(ctx) => {
                    ctx.set_properties.push((path, value));
                    Ok(status::OK)
                }
                None => Ok(status::NOT_FOUND),
            }
        }
    )?;
    Ok(())
}
