//! kvroute proxy-wasm filter (see issue 5).
