//! Sets `cfg(simd)` where the target has the 16-byte SIMD compares the token scanner's window
//! path is built on (src/intake/window.rs): wasm with `simd128` (the filter's build) and
//! x86-64 (SSE2, its baseline).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(simd)");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let has = |f: &str| features.split(',').any(|x| x == f);
    if (arch == "wasm32" && has("simd128")) || (arch == "x86_64" && has("sse2")) {
        println!("cargo::rustc-cfg=simd");
    }
}
