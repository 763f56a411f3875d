#!/usr/bin/env bash
# Latency/throughput benchmark of kvroute inside Envoy (not a test): see bench_latency.py.
# Installs what it needs: wrk (Debian), Envoy (install-envoy.sh), vllm-router (PyPI, for the
# side-by-side). Expects `make wasm` and `make native` done (the Makefile target does both).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! command -v wrk >/dev/null; then
  echo "bench_latency: installing wrk" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
fi
export ENVOY="${ENVOY:-$(bash "$here/install-envoy.sh")}"
exec python3 "$here/bench_latency.py" "$@"
