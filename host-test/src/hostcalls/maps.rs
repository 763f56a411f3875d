//! Header and trailer maps of the stream and of a callout's response.

use crate::abi::{self, status};
use crate::hostcalls::memory::{copy_out, read_or, write_u32};
use crate::hostcalls::register::{hostcall, Imports};

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    hostcall!(
        l,
        "proxy_get_header_map_size",
        |c, ty: i32, size_ptr: i32| {
            let size = match c.data_mut().map(ty) {
                Ok(m) => abi::serialize_pairs(m.iter_bytes()).len(),
                Err(st) => return Ok(st),
            };
            if !write_u32(&mut c, size_ptr, size as u32)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        }
    )?;
    hostcall!(
        l,
        "proxy_get_header_map_pairs",
        |c, ty: i32, ptr_ptr: i32, size_ptr: i32| {
            let bytes = match c.data_mut().map(ty) {
                Ok(m) => abi::serialize_pairs(m.iter_bytes()),
                Err(st) => return Ok(st),
            };
            copy_out(&mut c, &bytes, ptr_ptr, size_ptr)
        }
    )?;
    hostcall!(
        l,
        "proxy_set_header_map_pairs",
        |c, ty: i32, ptr: i32, size: i32| {
            let bytes = read_or!(&mut c, ptr, size);
            let Some(new) = abi::deserialize_pairs(&bytes) else {
                return Ok(status::SERIALIZATION_FAILURE);
            };
            match c.data_mut().map(ty) {
                Ok(m) => {
                    *m = new;
                    Ok(status::OK)
                }
                Err(st) => Ok(st),
            }
        }
    )?;
    hostcall!(
        l,
        "proxy_get_header_map_value",
        |c, ty: i32, kptr: i32, klen: i32, ptr_ptr: i32, size_ptr: i32| {
            let key = read_or!(&mut c, kptr, klen);
            let value = match c.data_mut().map(ty) {
                Ok(m) => match m.get_bytes(&key) {
                    Some(v) => v.to_vec(),
                    None => return Ok(status::NOT_FOUND),
                },
                Err(st) => return Ok(st),
            };
            copy_out(&mut c, &value, ptr_ptr, size_ptr)
        }
    )?;
    hostcall!(
        l,
        "proxy_add_header_map_value",
        |c, ty: i32, kptr: i32, klen: i32, vptr: i32, vlen: i32| {
            let key = read_or!(&mut c, kptr, klen);
            let value = read_or!(&mut c, vptr, vlen);
            match c.data_mut().map(ty) {
                Ok(m) => {
                    m.add_bytes(&key, &value);
                    Ok(status::OK)
                }
                Err(st) => Ok(st),
            }
        }
    )?;
    hostcall!(
        l,
        "proxy_replace_header_map_value",
        |c, ty: i32, kptr: i32, klen: i32, vptr: i32, vlen: i32| {
            let key = read_or!(&mut c, kptr, klen);
            let value = read_or!(&mut c, vptr, vlen);
            match c.data_mut().map(ty) {
                Ok(m) => {
                    m.set_bytes(&key, &value);
                    Ok(status::OK)
                }
                Err(st) => Ok(st),
            }
        }
    )?;
    hostcall!(
        l,
        "proxy_remove_header_map_value",
        |c, ty: i32, kptr: i32, klen: i32| {
            let key = read_or!(&mut c, kptr, klen);
            match c.data_mut().map(ty) {
                Ok(m) => {
                    m.remove_bytes(&key);
                    Ok(status::OK)
                }
                Err(st) => Ok(st),
            }
        }
    )?;
    Ok(())
}
