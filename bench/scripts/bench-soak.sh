#!/usr/bin/env bash
# The collector soak: the real kvroute-collector binary, a simulated fleet and hostile peers
# for M minutes, RSS sampled every second. Writes bench-out/soak/soak.{json,md}.
# Usage: bash bench/scripts/bench-soak.sh [--minutes M] [--engines N] [other soak flags]
# The arguments go to `kvroute-bench soak` (see its --help); default 30 minutes, 64 engines.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
JOBS="${JOBS:-2}"
cargo build -q -j"$JOBS" --profile native -p kvroute-collector
cargo build -q -j"$JOBS" --profile bench -p kvroute-bench --bin kvroute-bench
"$CARGO_TARGET_DIR/release/kvroute-bench" soak \
  --collector "$CARGO_TARGET_DIR/native/kvroute-collector" "$@"
