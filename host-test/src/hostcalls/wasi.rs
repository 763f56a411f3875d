//! The WASI preview1 functions proxy-wasm-cpp-host links (under each WASI module name).

use crate::abi::LogLevel;
use crate::hostcalls::memory::{read, write, write_u32};
use crate::hostcalls::register::{hostcall, Imports, R};

/// WASI errno values.
mod errno {
    pub const SUCCESS: i32 = 0;
    pub const BADF: i32 = 8;
    pub const INVAL: i32 = 28;
    pub const NOENT: i32 = 44;
    pub const NOSYS: i32 = 52;
}

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    // stdout/stderr become log lines at info/error, as Envoy does.
    hostcall!(l, "fd_write", always, |mut c,
                                      fd: i32,
                                      iovs: i32,
                                      iovs_len: i32,
                                      nwritten: i32|
     -> R {
        let mut data = Vec::new();
        for i in 0..iovs_len.max(0) {
            let Some(iov) = read(&mut c, iovs.wrapping_add(i * 8), 8)? else {
                return Ok(errno::INVAL);
            };
            let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
            let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
            let Some(bytes) = read(&mut c, ptr, len)? else {
                return Ok(errno::INVAL);
            };
            data.extend_from_slice(&bytes);
        }
        let level = match fd {
            1 => LogLevel::Info,
            2 => LogLevel::Error,
            _ => return Ok(errno::BADF),
        };
        // Unbuffered stderr arrives in pieces: log whole lines.
        let pending = &mut c.data_mut().fd_lines[(fd - 1) as usize];
        pending.extend_from_slice(&data);
        let mut complete = Vec::new();
        while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            complete.push(String::from_utf8_lossy(&line[..line.len() - 1]).into_owned());
        }
        for line in complete {
            c.data_mut().log(level, line);
        }
        if !write_u32(&mut c, nwritten, data.len() as u32)? {
            return Ok(errno::INVAL);
        }
        Ok(errno::SUCCESS)
    })?;
    hostcall!(l, "fd_read", always, |_,
                                     _: i32,
                                     _: i32,
                                     _: i32,
                                     _: i32|
     -> i32 { errno::NOSYS })?;
    hostcall!(l, "fd_seek", always, |_,
                                     _: i32,
                                     _: i64,
                                     _: i32,
                                     _: i32|
     -> i32 { errno::NOSYS })?;
    hostcall!(l, "fd_close", always, |_, _: i32| -> i32 { errno::NOSYS })?;
    hostcall!(l, "fd_fdstat_get", always, |mut c,
                                           fd: i32,
                                           ptr: i32|
     -> R {
        if !(0..=2).contains(&fd) {
            return Ok(errno::BADF);
        }
        // filetype character device (2), no flags, all rights.
        let mut stat = [0u8; 24];
        stat[0] = 2;
        stat[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        stat[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        Ok(if write(&mut c, ptr, &stat)? {
            errno::SUCCESS
        } else {
            errno::INVAL
        })
    })?;
    hostcall!(l, "environ_sizes_get", always, |mut c,
                                               count_ptr: i32,
                                               size_ptr: i32|
     -> R {
        let env = c.data().opts.env.clone();
        let size: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        if !write_u32(&mut c, count_ptr, env.len() as u32)?
            || !write_u32(&mut c, size_ptr, size as u32)?
        {
            return Ok(errno::INVAL);
        }
        Ok(errno::SUCCESS)
    })?;
    hostcall!(l, "environ_get", always, |mut c,
                                         ptrs: i32,
                                         buf: i32|
     -> R {
        let env = c.data().opts.env.clone();
        let mut at = buf;
        for (i, (k, v)) in env.iter().enumerate() {
            let entry = format!("{k}={v}\0");
            if !write_u32(&mut c, ptrs + 4 * i as i32, at as u32)?
                || !write(&mut c, at, entry.as_bytes())?
            {
                return Ok(errno::INVAL);
            }
            at += entry.len() as i32;
        }
        Ok(errno::SUCCESS)
    })?;
    hostcall!(l, "args_sizes_get", always, |mut c,
                                            count_ptr: i32,
                                            size_ptr: i32|
     -> R {
        if !write_u32(&mut c, count_ptr, 0)? || !write_u32(&mut c, size_ptr, 0)? {
            return Ok(errno::INVAL);
        }
        Ok(errno::SUCCESS)
    })?;
    hostcall!(l, "args_get", always, |_, _: i32, _: i32| -> i32 {
        errno::SUCCESS
    })?;
    // Both clocks follow the test clock.
    hostcall!(l, "clock_time_get", always, |mut c,
                                            id: i32,
                                            _precision: i64,
                                            ptr: i32|
     -> R {
        if !(0..=1).contains(&id) {
            return Ok(errno::INVAL);
        }
        let now = c.data().now();
        Ok(if write(&mut c, ptr, &now.to_le_bytes())? {
            errno::SUCCESS
        } else {
            errno::INVAL
        })
    })?;
    hostcall!(l, "random_get", always, |mut c, ptr: i32, len: i32| -> R {
        let mut bytes = Vec::with_capacity(len.max(0) as usize);
        while bytes.len() < len.max(0) as usize {
            bytes.extend_from_slice(&c.data_mut().next_random().to_le_bytes());
        }
        bytes.truncate(len.max(0) as usize);
        Ok(if write(&mut c, ptr, &bytes)? {
            errno::SUCCESS
        } else {
            errno::INVAL
        })
    })?;
    hostcall!(l, "proc_exit", always, |_,
                                       code: i32|
     -> wasmtime::Result<()> {
        wasmtime::bail!("proc_exit({code})")
    })?;
    hostcall!(l, "path_open", always, |_,
                                       _: i32,
                                       _: i32,
                                       _: i32,
                                       _: i32,
                                       _: i32,
                                       _: i64,
                                       _: i64,
                                       _: i32,
                                       _: i32|
     -> i32 { errno::NOENT })?;
    // No preopened directories.
    hostcall!(l, "fd_prestat_get", always, |_, _: i32, _: i32| -> i32 {
        errno::BADF
    })?;
    hostcall!(l, "fd_prestat_dir_name", always, |_,
                                                 _: i32,
                                                 _: i32,
                                                 _: i32|
     -> i32 {
        errno::BADF
    })?;
    Ok(())
}
