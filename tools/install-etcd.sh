#!/usr/bin/env bash
# Installs etcd (the discovery store of Dynamo deployments outside Kubernetes; the etcd phase of
# `make test-dynamo-interop`) from Debian's `etcd-server` package. Verified here: bookworm's
# 3.4.23, whose JSON gateway serves `POST /v3/kv/range`. Does nothing when etcd is on PATH.
# Prints the path.
set -euo pipefail
if ! command -v etcd >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends etcd-server >/dev/null \
    || { $SUDO apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends etcd-server >/dev/null; }
fi
command -v etcd
