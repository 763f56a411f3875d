//! Metrics: process-wide in Envoy, so every VM defining a name shares the stat.

use crate::abi::{status, MetricKind};
use crate::hostcalls::memory::{read_or, write, write_u32};
use crate::hostcalls::register::{hostcall, Imports};
use crate::shared::Metric;

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    hostcall!(
        l,
        "proxy_define_metric",
        |c, ty: i32, nptr: i32, nlen: i32, id_ptr: i32| {
            let name = String::from_utf8_lossy(&read_or!(&mut c, nptr, nlen)).into_owned();
            let Some(kind) = MetricKind::from_abi(ty) else {
                return Ok(status::BAD_ARGUMENT);
            };
            let id = {
                let mut inner = c.data().shared.lock();
                match inner.metrics.iter().position(|m| m.name == name) {
                    Some(i) if inner.metrics[i].kind == kind => i + 1,
                    Some(_) => return Ok(status::BAD_ARGUMENT),
                    None => {
                        inner.metrics.push(Metric {
                            name,
                            kind,
                            value: 0,
                            samples: Vec::new(),
                        });
                        inner.metrics.len()
                    }
                }
            };
            if !write_u32(&mut c, id_ptr, id as u32)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        }
    )?;
    hostcall!(l, "proxy_increment_metric", |c, id: i32, offset: i64| {
        let mut inner = c.data().shared.lock();
        let Some(m) = (id as u32 as usize)
            .checked_sub(1)
            .and_then(|i| inner.metrics.get_mut(i))
        else {
            return Ok(status::NOT_FOUND);
        };
        match m.kind {
            // Envoy counters only go up.
            MetricKind::Counter if offset > 0 => m.value = m.value.wrapping_add(offset as u64),
            MetricKind::Gauge => m.value = m.value.wrapping_add(offset as u64),
            _ => return Ok(status::BAD_ARGUMENT),
        }
        Ok(status::OK)
    })?;
    hostcall!(l, "proxy_record_metric", |c, id: i32, value: i64| {
        let mut inner = c.data().shared.lock();
        let Some(m) = (id as u32 as usize)
            .checked_sub(1)
            .and_then(|i| inner.metrics.get_mut(i))
        else {
            return Ok(status::NOT_FOUND);
        };
        let value = value as u64;
        match m.kind {
            MetricKind::Counter => m.value = m.value.wrapping_add(value),
            MetricKind::Gauge => m.value = value,
            MetricKind::Histogram => m.samples.push(value),
        }
        Ok(status::OK)
    })?;
    hostcall!(l, "proxy_get_metric", |c, id: i32, ptr: i32| {
        let value = {
            let inner = c.data().shared.lock();
            let Some(m) = (id as u32 as usize)
                .checked_sub(1)
                .and_then(|i| inner.metrics.get(i))
            else {
                return Ok(status::NOT_FOUND);
            };
            if m.kind == MetricKind::Histogram {
                return Ok(status::BAD_ARGUMENT);
            }
            m.value
        };
        if !write(&mut c, ptr, &value.to_le_bytes())? {
            return Ok(status::INVALID_MEMORY_ACCESS);
        }
        Ok(status::OK)
    })?;
    Ok(())
}
