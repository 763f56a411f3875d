#!/usr/bin/env bash
# The routing benchmark (issue 10): kvroute as shipped — a real Envoy with the filter .wasm and
# the collector, Envoy's fallback round-robin — beside the in-process policies and the PyPI
# peers (vllm-router 0.1.17, sglang-router 0.3.2, installed into sim/.venv-peers, ignored by
# git), on one simulated fleet, in four scenarios: the Mooncake trace through one gateway, two
# gateway replicas (fleet-wide load on and off), a hot-prefix burst, and `text` (issue 14: the
# trace as chat messages and prompt strings on a second fleet whose engines and collector use
# the real Qwen3 tokenizer of testdata/tokenizer/qwen3). A peer that fails to install, or an
# Envoy that does not start, is reported as skipped.
#
# The filter is $KVROUTE_WASM, else <target dir>/wasm32-wasip1/release/kvroute_filter.wasm
# (`make wasm`); Envoy is $ENVOY, else envoy-config/install-envoy.sh's. Extra arguments go to
# `kvroute-bench routing` (see its --help); results go to bench-out/ (results.md, results.json,
# one directory of plots and per-request JSONL per scenario).
#
#   bench/scripts/bench-routing.sh --speed 10 --limit 2000     # make bench-routing (~10 min)
#   bench/scripts/bench-routing.sh --limit 300 --scenarios trace  # a quick look
#   bench/scripts/bench-routing.sh --speed 10 --limit 2000 --scenarios text  # text routing only
#   bench/scripts/bench-routing.sh --limit 200 --scenarios failure  # one of the scenarios run only
#     when named: uneven, heterogeneous, no-events, decode-heavy, failure, scale, shared-prefix
#     (make bench-routing-scenarios runs them all)
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
ENVOY="${ENVOY:-$(bash envoy-config/install-envoy.sh)}"
export ENVOY
cargo build -j"${JOBS:-2}" --profile native -p kvroute-bench --bin kvroute-bench
exec "${CARGO_TARGET_DIR:-target}/native/kvroute-bench" routing --out bench-out --venv "$VENV" "$@"
