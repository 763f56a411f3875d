#!/usr/bin/env bash
# Installs nats-server (the JetStream server of the collector's optional event bus, issue 23)
# from Debian's `nats-server` package (Debian puts it in /usr/sbin). Verified here: bookworm's 2.9.10, which
# has JetStream (`-js`). Does nothing when nats-server is on PATH. Prints the path.
set -euo pipefail
if ! command -v nats-server >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends nats-server >/dev/null \
    || { $SUDO apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends nats-server >/dev/null; }
fi
command -v nats-server
