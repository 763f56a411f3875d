//! Acceptance tests of the kvroute filter: the real `.wasm` in the host-test crate.
