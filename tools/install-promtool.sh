#!/usr/bin/env bash
# Installs promtool (for `make check-rules`) from Debian's `prometheus` package, which ships it
# in /usr/bin. Verified here: bookworm's prometheus 2.42. Does nothing when promtool is on PATH.
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null
