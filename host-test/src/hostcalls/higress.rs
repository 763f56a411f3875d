//! Higress's extra imports, linked only in Higress mode.

use crate::abi::{self, status};
use crate::hostcalls::memory::{copy_out, read_or};
use crate::hostcalls::register::{hostcall, Imports};

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    hostcall!(
        l,
        "proxy_set_upstream_override_host",
        |c, ptr: i32, len: i32| {
            let host = read_or!(&mut c, ptr, len);
            match c.data_mut().http() {
                Some(ctx) => {
                    ctx.override_host = Some(host);
                    Ok(status::OK)
                }
                None => Ok(status::BAD_ARGUMENT),
            }
        }
    )?;
    hostcall!(
        l,
        "proxy_get_upstream_hosts",
        |c, ptr_ptr: i32, size_ptr: i32| {
            let hosts = c.data().shared.lock().upstream_hosts.clone();
            let bytes =
                abi::serialize_pairs(hosts.iter().map(|(a, i)| (a.as_bytes(), i.as_bytes())));
            copy_out(&mut c, &bytes, ptr_ptr, size_ptr)
        }
    )?;
    Ok(())
}
