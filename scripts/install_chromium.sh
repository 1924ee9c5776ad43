#!/usr/bin/env bash
# Chromium and chromedriver from Debian's packages, for the chat page's browser test
# (tests/test_chat_page.py). Nothing to do where both are on PATH; without root (or sudo that
# asks no password) it says so and the browser tests skip, naming this script.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if [ "$(id -u)" = 0 ]; then
    SUDO=()
elif sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "install_chromium.sh: not root: run 'sudo apt-get install chromium chromium-driver'" \
        "for the browser tests (they skip meanwhile)" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install_chromium.sh: no apt-get here: install Chromium and chromedriver" \
        "(CHROMIUM=... CHROMEDRIVER=... name them) for the browser tests" >&2
    exit 0
fi
echo "installing chromium and chromium-driver (Debian packages) for the browser tests"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
