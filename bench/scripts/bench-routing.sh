#!/usr/bin/env bash
# The routing benchmark of issue 6: builds kvroute-bench (profile `native`), installs the PyPI
# peers (vllm-router 0.1.17, sglang-router 0.3.2) into sim/.venv-peers (ignored by git) and
# runs every policy on the synthetic Mooncake trace. A peer that fails to install is skipped
# by the bench, which says so. Extra arguments go to `kvroute-bench routing` (see its --help);
# results go to sim/bench-out, next to the simulator they measure.
#
#   bench/scripts/bench-routing.sh                     # the documented run (sim/BENCH.md)
#   bench/scripts/bench-routing.sh --limit 500         # a quick look
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=sim/.venv-peers
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" || echo "bench: cannot create $VENV; peers will be skipped" >&2
fi
if [ -x "$VENV/bin/pip" ]; then
  [ -x "$VENV/bin/vllm-router" ] || "$VENV/bin/pip" install -q vllm-router==0.1.17 \
    || echo "bench: vllm-router 0.1.17 did not install; it will be skipped" >&2
  "$VENV/bin/python" -c "import sglang_router" 2>/dev/null || "$VENV/bin/pip" install -q sglang-router==0.3.2 \
    || echo "bench: sglang-router 0.3.2 did not install; it will be skipped" >&2
fi
cargo build --profile native -p kvroute-bench --bin kvroute-bench
exec "${CARGO_TARGET_DIR:-target}/native/kvroute-bench" routing --out sim/bench-out --venv "$VENV" "$@"
