//! Shared data and shared queues, shared by every VM of the gateway.

use crate::abi::status;
use crate::hostcalls::memory::{copy_out, read_or, write_u32};
use crate::hostcalls::register::{hostcall, Imports};

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    // Shared data.
    hostcall!(
        l,
        "proxy_get_shared_data",
        |c, kptr: i32, klen: i32, ptr_ptr: i32, size_ptr: i32, cas_ptr: i32| {
            let key = read_or!(&mut c, kptr, klen);
            let entry = c.data().shared.lock().shared_data.map.get(&key).cloned();
            let Some(entry) = entry else {
                return Ok(status::NOT_FOUND);
            };
            let st = copy_out(&mut c, &entry.value, ptr_ptr, size_ptr)?;
            if st != status::OK {
                return Ok(st);
            }
            if !write_u32(&mut c, cas_ptr, entry.cas)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        }
    )?;
    hostcall!(
        l,
        "proxy_set_shared_data",
        |c, kptr: i32, klen: i32, vptr: i32, vlen: i32, cas: i32| {
            let key = read_or!(&mut c, kptr, klen);
            let value = read_or!(&mut c, vptr, vlen);
            let result = c
                .data()
                .shared
                .lock()
                .shared_data
                .set(&key, &value, cas as u32);
            Ok(if result.is_ok() {
                status::OK
            } else {
                status::CAS_MISMATCH
            })
        }
    )?;

    // Shared queues.
    hostcall!(
        l,
        "proxy_register_shared_queue",
        |c, nptr: i32, nlen: i32, id_ptr: i32| {
            let name = String::from_utf8_lossy(&read_or!(&mut c, nptr, nlen)).into_owned();
            let s = c.data();
            let token = s
                .shared
                .lock()
                .queues
                .register(&s.opts.vm_id, &name, s.worker, s.root_id);
            if !write_u32(&mut c, id_ptr, token)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        }
    )?;
    hostcall!(
        l,
        "proxy_resolve_shared_queue",
        |c, vptr: i32, vlen: i32, nptr: i32, nlen: i32, id_ptr: i32| {
            let vm_id = String::from_utf8_lossy(&read_or!(&mut c, vptr, vlen)).into_owned();
            let name = String::from_utf8_lossy(&read_or!(&mut c, nptr, nlen)).into_owned();
            let token = c.data().shared.lock().queues.resolve(&vm_id, &name);
            let Some(token) = token else {
                return Ok(status::NOT_FOUND);
            };
            if !write_u32(&mut c, id_ptr, token)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        }
    )?;
    hostcall!(
        l,
        "proxy_enqueue_shared_queue",
        |c, token: i32, ptr: i32, len: i32| {
            let value = read_or!(&mut c, ptr, len);
            let mut inner = c.data().shared.lock();
            let Some(q) = inner.queues.by_token.get_mut(&(token as u32)) else {
                return Ok(status::NOT_FOUND);
            };
            q.items.push_back(value);
            let ready = (q.owner_vm, q.owner_root, token as u32);
            inner.queue_ready.push(ready);
            Ok(status::OK)
        }
    )?;
    hostcall!(
        l,
        "proxy_dequeue_shared_queue",
        |c, token: i32, ptr_ptr: i32, size_ptr: i32| {
            let item = {
                let mut inner = c.data().shared.lock();
                let Some(q) = inner.queues.by_token.get_mut(&(token as u32)) else {
                    return Ok(status::NOT_FOUND);
                };
                match q.items.pop_front() {
                    Some(item) => item,
                    None => return Ok(status::EMPTY),
                }
            };
            copy_out(&mut c, &item, ptr_ptr, size_ptr)
        }
    )?;
    Ok(())
}
