//! Helpers for benchmarks of a module's per-request cost: run N requests, report wall time
//! and fuel. Fuel (wasmtime's count of executed wasm operators) is machine-independent: use
//! it to compare builds and changes; wall time depends on the machine.
//!
//! ```no_run
//! use kvroute_host_test::{bench, built_wasm, Gateway};
//! let mut gw = Gateway::builder(built_wasm("kvroute_filter")?)
//!     .config(r#"{"collector":{"cluster":"kvroute_collector"}}"#)
//!     .allow_on_headers_stop_iteration(true)
//!     .build()?;
//! gw.prefill_shared_data((0..10_000).map(|i| (format!("k{i}"), vec![0u8; 64])));
//! let run = bench::run(&mut gw, 1_000, |i, req| req.header("x-token-ids", &format!("{i}")))?;
//! println!("{:?} and {} fuel per request", run.wall_per_request(), run.fuel_per_request());
//! # Ok::<(), kvroute_host_test::HostError>(())
//! ```

use std::time::{Duration, Instant};

use crate::gateway::Gateway;
use crate::request::RequestBuilder;
use crate::types::{HostError, StreamState};

/// Totals of a run of requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BenchRun {
    /// Requests run.
    pub requests: u64,
    /// Wall time of the whole run.
    pub wall: Duration,
    /// Fuel consumed by every callback of these requests (0 with fuel off).
    pub fuel: u64,
}

impl BenchRun {
    /// Mean wall time per request.
    pub fn wall_per_request(&self) -> Duration {
        self.wall / self.requests.max(1) as u32
    }

    /// Mean fuel per request.
    pub fn fuel_per_request(&self) -> u64 {
        self.fuel / self.requests.max(1)
    }
}

/// Runs `n` requests built by `make(i, builder)`, each to completion (callouts answered by
/// their clusters), and measures them.
///
/// # Errors
/// The first request that trapped or did not complete (paused, reset).
pub fn run<F>(gw: &mut Gateway, n: u64, mut make: F) -> Result<BenchRun, HostError>
where
    F: for<'g> FnMut(u64, RequestBuilder<'g>) -> RequestBuilder<'g>,
{
    let fuel_before = gw.fuel_total();
    let start = Instant::now();
    for i in 0..n {
        let outcome = make(i, gw.request()).send();
        match outcome.state {
            StreamState::Complete => {}
            StreamState::Failed(e) => return Err(e),
            other => {
                return Err(HostError::Incomplete {
                    request: i,
                    state: format!("{other:?}"),
                })
            }
        }
    }
    let wall = start.elapsed();
    Ok(BenchRun {
        requests: n,
        wall,
        fuel: gw.fuel_total() - fuel_before,
    })
}
