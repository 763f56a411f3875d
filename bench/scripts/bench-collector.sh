#!/usr/bin/env bash
# The collector's benchmarks, with NVIDIA Dynamo's standalone indexer side by side.
# Writes collector/BENCH.md. Usage: bash bench/scripts/bench-collector.sh [bench args]
#   e.g. bash bench/scripts/bench-collector.sh --blocks 1000000 --concurrency 32 --seconds 5
# The arguments go to `kvroute-bench collector` (see its --help).
# Set NO_DYNAMO=1 to skip the Dynamo column (no PyPI access needed then).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=collector/.venv-bench
DYN=()
if [ -z "${NO_DYNAMO:-}" ]; then
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import dynamo._core' 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q 'ai-dynamo-runtime==1.6.1'
  fi
  DYN=(--dynamo "$VENV/bin/python")
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
cargo build -q --profile bench -p kvroute-bench --bin kvroute-bench
"$CARGO_TARGET_DIR/release/kvroute-bench" collector "${DYN[@]}" "$@" > collector/BENCH.md.new
mv collector/BENCH.md.new collector/BENCH.md
cat collector/BENCH.md
