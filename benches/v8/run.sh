#!/usr/bin/env bash
# Builds benches/v8 (the core's intake and hashing as a wasm32-wasip1 cdylib, the filter's
# release profile) and times it in Node's V8 with liftoff off, as Envoy runs the filter.
# Extra arguments: more builds of the same exports to time beside it (before/after).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target="$here/../../target/v8bench"
cargo build -j"${JOBS:-2}" --release --target wasm32-wasip1 \
  --manifest-path "$here/Cargo.toml" --target-dir "$target" >&2
exec node --no-liftoff --no-warnings "$here/bench.mjs" \
  "$target/wasm32-wasip1/release/kvroute_v8bench.wasm" "$@"
