#!/bin/sh
# `make test` needs `promtool` (alert-rule unit tests) and `prometheus` (the dashboard query test runs one).
# Find them; else install Debian's prometheus package when running as root with apt; else say exactly what
# is missing and how to get it. (No PyPI or npm package ships them.)
set -eu
have() { command -v "$1" >/dev/null 2>&1; }
missing() { for tool in promtool prometheus; do have "$tool" || printf '%s ' "$tool"; done; }

[ -z "$(missing)" ] && exit 0
if [ "$(id -u)" = 0 ] && have apt-get; then
  echo "make test: $(missing)not found: installing Debian's prometheus package (apt-get install prometheus)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # The package may start a system Prometheus on :9090; the tests run their own on free ports.
  (service prometheus stop || /etc/init.d/prometheus stop || true) >/dev/null 2>&1
  [ -z "$(missing)" ] && exit 0
fi
cat >&2 <<MSG
make test: missing $(missing)(Prometheus' tools; three tests run them).
  Debian/Ubuntu:  sudo apt-get install prometheus        (ships promtool and prometheus)
  elsewhere:      download prometheus-<version>.linux-amd64.tar.gz from the Prometheus releases page and
                  put its promtool and prometheus binaries on PATH.
MSG
exit 1
