//! Benchmarks of the host running a module: `cargo bench -p kvroute-host-test`.
//! Warm-up and measurement are short by default; override on the command line
//! (`-- --measurement-time 10`). Each case also prints its fuel per request, a
//! machine-independent figure (wasm operators executed).

use criterion::{criterion_group, criterion_main, Criterion};

mod host;

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2))
        .configure_from_args()
}

criterion_group! {
    name = benches;
    config = config();
    targets = host::request
}
criterion_main!(benches);
