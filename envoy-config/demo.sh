#!/usr/bin/env bash
# `make demo` without make: build the filter and the native binaries, install Envoy, replay a
# slice of the Mooncake trace through Envoy + kvroute and through round-robin, print the table
# and write demo-results.json in the current directory. Extra arguments go to `run.py demo`
# (e.g. --limit 200 --speed 1 --engines 4).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$here/install-envoy.sh" >/dev/null
exec python3 "$here/run.py" demo "$@"
