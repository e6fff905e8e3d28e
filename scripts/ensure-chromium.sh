#!/bin/sh
# `make test` needs a headless Chromium at /usr/bin/chromium: the portal's browser tests (tests/service/portal)
# drive it with Playwright, which is told never to download a browser of its own. Find it; else install Debian's
# chromium package when running as root with apt; else say exactly what is missing and how to get it.
set -eu
CHROMIUM=/usr/bin/chromium
have() { command -v "$1" >/dev/null 2>&1; }

[ -x "$CHROMIUM" ] && exit 0
if [ "$(id -u)" = 0 ] && have apt-get; then
  echo "make test: $CHROMIUM not found: installing Debian's chromium package (apt-get install chromium)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends chromium >/dev/null
  [ -x "$CHROMIUM" ] && exit 0
fi
cat >&2 <<MSG
make test: missing $CHROMIUM (a headless Chromium; the portal's browser tests in tests/service/portal run it).
  Debian:  sudo apt-get install chromium
  elsewhere: install Chromium from your distribution's packages so that $CHROMIUM runs it headless
             (a link to the binary will do), e.g. sudo ln -s "\$(command -v chromium-browser)" $CHROMIUM
MSG
exit 1
