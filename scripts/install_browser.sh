#!/usr/bin/env bash
# Install headless Chromium (Debian packages `chromium`, `chromium-driver`; `fonts-liberation` so
# a clean box renders text) for the HTML report's browser tests (tests/solver/test_html_report.py). Idempotent: returns at once when `chromium`
# is on PATH. Never fails the caller: without root or apt-get it says what to install and the
# browser tests then fail with the same hint.
set -uo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no apt-get here; install Chromium yourself for the browser tests" >&2
    exit 0
fi
sudo=""
if [[ "$(id -u)" != 0 ]]; then
    if sudo -n true 2>/dev/null; then
        sudo="sudo -n"
    else
        echo "install_browser: not root; run: apt-get install -y chromium chromium-driver fonts-liberation" >&2
        exit 0
    fi
fi
echo "install_browser: installing chromium (Debian packages, once)"
export DEBIAN_FRONTEND=noninteractive
if ! $sudo apt-get install -y --no-install-recommends chromium chromium-driver fonts-liberation >/dev/null 2>&1; then
    # a fresh machine has no package lists yet
    $sudo apt-get update -qq >/dev/null 2>&1 || true
    $sudo apt-get install -y --no-install-recommends chromium chromium-driver fonts-liberation >/dev/null 2>&1 ||
        echo "install_browser: apt-get could not install chromium; the browser tests will fail" >&2
fi
exit 0
