#!/usr/bin/env bash
# Makes sure the services the test suite talks to are installed (the tests start and stop them on 127.0.0.1).
# Redis: Debian's redis-server, for LMCache's remote backend tests, installed with apt-get as root (or through
# passwordless sudo). Where it cannot be installed, the Redis tests skip on a developer's machine; under CI
# (CI=true) that is an error here, and the tests fail too (tests/ci.py).
set -euo pipefail

in_ci() { case "${CI:-}" in 1 | [Tt][Rr][Uu][Ee] | [Yy][Ee][Ss]) return 0 ;; *) return 1 ;; esac }

if command -v redis-server >/dev/null 2>&1; then exit 0; fi

as_root=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then as_root=(sudo -n); else as_root=(none); fi
fi
if [ "${as_root[0]:-}" != none ] && command -v apt-get >/dev/null 2>&1; then
  echo "lmcache_platforms: installing redis-server for the remote-backend tests"
  "${as_root[@]}" apt-get update -qq >/dev/null
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  # The package may start a system-wide server; the tests run their own on a free port. Stop the service
  # only (never every redis-server process on the machine).
  "${as_root[@]}" service redis-server stop >/dev/null 2>&1 || true
fi

if command -v redis-server >/dev/null 2>&1; then exit 0; fi
if in_ci; then
  echo "lmcache_platforms: redis-server is not installed and cannot be installed here (needs root or" \
       "passwordless sudo, and apt-get); CI=true requires it for the Redis remote-backend tests" >&2
  exit 1
fi
echo "lmcache_platforms: redis-server not installed and cannot install it here; Redis tests will be skipped" >&2
