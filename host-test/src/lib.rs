//! proxy-wasm host for tests (see issue 4).
