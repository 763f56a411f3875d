//! Arbitrary bytes into the msgpack batch decoder: an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvroute_collector::decode::decode(data);
});
