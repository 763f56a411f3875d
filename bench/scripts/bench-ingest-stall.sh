#!/usr/bin/env bash
# /query latency while one 3.5M-block batch goes into the collector's index, sliced and not.
# Writes bench-out/ingest-stall.md. Usage: bash bench/scripts/bench-ingest-stall.sh [flags]
# The arguments go to `kvroute-bench ingest-stall` (see its --help).
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
cargo build -q -j"${JOBS:-2}" --profile bench -p kvroute-bench --bin kvroute-bench
mkdir -p bench-out
"$CARGO_TARGET_DIR/release/kvroute-bench" ingest-stall "$@" > bench-out/ingest-stall.md
cat bench-out/ingest-stall.md
