//! Guest memory access for hostcalls: reading and writing the module's memory, and
//! copying values out into memory the module allocates.

use wasmtime::Memory;

use crate::abi::status;
use crate::hostcalls::register::{C, R};

fn memory(c: &C<'_>) -> wasmtime::Result<Memory> {
    c.data()
        .memory
        .ok_or_else(|| wasmtime::format_err!("module exports no memory"))
}

pub(crate) fn read(c: &mut C<'_>, ptr: i32, len: i32) -> wasmtime::Result<Option<Vec<u8>>> {
    let mem = memory(c)?;
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    Ok(mem
        .data(&*c)
        .get(ptr..ptr.saturating_add(len))
        .map(<[u8]>::to_vec))
}

pub(crate) fn write(c: &mut C<'_>, ptr: i32, bytes: &[u8]) -> wasmtime::Result<bool> {
    let mem = memory(c)?;
    let ptr = ptr as u32 as usize;
    match mem
        .data_mut(&mut *c)
        .get_mut(ptr..ptr.saturating_add(bytes.len()))
    {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            Ok(true)
        }
        None => Ok(false),
    }
}

pub(crate) fn write_u32(c: &mut C<'_>, ptr: i32, v: u32) -> wasmtime::Result<bool> {
    write(c, ptr, &v.to_le_bytes())
}

/// Copies `bytes` into memory the module allocates (`proxy_on_memory_allocate`) and writes
/// pointer and size (cpp-host `copyToPointerSize`: an empty value is a null pointer).
pub(crate) fn copy_out(c: &mut C<'_>, bytes: &[u8], ptr_ptr: i32, size_ptr: i32) -> R {
    let ptr = if bytes.is_empty() {
        0
    } else {
        let alloc = c
            .data()
            .alloc
            .clone()
            .ok_or_else(|| wasmtime::format_err!("module exports no allocator"))?;
        let ptr = alloc.call(&mut *c, bytes.len() as i32)?;
        if ptr == 0 || !write(c, ptr, bytes)? {
            return Ok(status::INVALID_MEMORY_ACCESS);
        }
        ptr
    };
    if !write_u32(c, ptr_ptr, ptr as u32)? || !write_u32(c, size_ptr, bytes.len() as u32)? {
        return Ok(status::INVALID_MEMORY_ACCESS);
    }
    Ok(status::OK)
}

/// Reads guest memory, or returns `InvalidMemoryAccess` from the hostcall.
macro_rules! read_or {
    ($c:expr, $ptr:expr, $len:expr) => {
        match $crate::hostcalls::memory::read($c, $ptr, $len)? {
            Some(v) => v,
            None => return Ok($crate::abi::status::INVALID_MEMORY_ACCESS),
        }
    };
}

pub(crate) use read_or;

/// A property path as the ABI sends it: segments separated (and maybe ended) by NUL.
pub(crate) fn split_path(bytes: &[u8]) -> Vec<String> {
    let trimmed = bytes.strip_suffix(&[0]).unwrap_or(bytes);
    trimmed
        .split(|b| *b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}
