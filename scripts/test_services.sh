#!/usr/bin/env bash
# Makes sure the services the test suite talks to are installed (the tests start and stop them on 127.0.0.1).
# Redis: Debian's redis-server, for LMCache's remote backend tests. Without root/apt the tests skip them.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "lmcache_platforms: installing redis-server for the remote-backend tests"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  # the package starts a system-wide server; the tests run their own on a free port
  (command -v systemctl >/dev/null && systemctl stop redis-server) >/dev/null 2>&1 || true
  pkill -x redis-server >/dev/null 2>&1 || true
else
  echo "lmcache_platforms: redis-server not installed and cannot install it here; Redis tests will be skipped" >&2
fi
