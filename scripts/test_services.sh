#!/usr/bin/env bash
# Makes sure the programs the test suite runs are installed (the tests start and stop servers on 127.0.0.1),
# with apt-get as root (or through passwordless sudo):
# - Debian's redis-server, for LMCache's remote backend tests. Where it cannot be installed, the Redis tests skip
#   on a developer's machine; under CI (CI=true) that is an error here, and the tests fail too (tests/ci.py).
# - an aarch64 cross compiler and qemu, to build the CRC-32C code for aarch64 (Ascend hosts are often Kunpeng
#   servers) and run its tests there (tests/kernels/test_crc32c_cross.py). Best effort, also under CI: where they
#   cannot be installed (no package mirror), those tests skip and say why.
set -euo pipefail

in_ci() { case "${CI:-}" in 1 | [Tt][Rr][Uu][Ee] | [Yy][Ee][Ss]) return 0 ;; *) return 1 ;; esac }

# command -> Debian package
declare -A PACKAGE=([redis-server]=redis-server [aarch64-linux-gnu-gcc]=gcc-aarch64-linux-gnu [qemu-aarch64]=qemu-user)

absent() { for command in "${!PACKAGE[@]}"; do command -v "$command" >/dev/null 2>&1 || echo "$command"; done; }

missing=$(absent)
if [ -z "$missing" ]; then exit 0; fi

as_root=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then as_root=(sudo -n); else as_root=(none); fi
fi
if [ "${as_root[0]:-}" != none ] && command -v apt-get >/dev/null 2>&1; then
  packages=$(for command in $missing; do echo "${PACKAGE[$command]}"; done | sort -u | tr '\n' ' ')
  echo "lmcache_platforms: installing $packages for the tests"
  "${as_root[@]}" timeout 300 apt-get update -qq >/dev/null || echo "lmcache_platforms: apt-get update failed" >&2
  # shellcheck disable=SC2086 # one word per package
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq $packages >/dev/null ||
    echo "lmcache_platforms: apt-get install $packages failed" >&2
  # The Redis package may start a system-wide server; the tests run their own on a free port. Stop the service
  # only (never every redis-server process on the machine).
  case " $packages " in *" redis-server "*) "${as_root[@]}" service redis-server stop >/dev/null 2>&1 || true ;; esac
fi

missing=$(absent)
if [ -z "$missing" ]; then exit 0; fi
if ! command -v redis-server >/dev/null 2>&1 && in_ci; then
  echo "lmcache_platforms: redis-server is not installed and cannot be installed here (needs root or" \
       "passwordless sudo, and apt-get); CI=true requires it for the Redis remote-backend tests" >&2
  exit 1
fi
echo "lmcache_platforms: $(echo $missing) not installed and cannot install here; the tests that need them will be" \
     "skipped" >&2
