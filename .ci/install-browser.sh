#!/usr/bin/env bash
# Installs what tests/observability's browser test needs: Debian's chromium (and its
# WebDriver, for Selenium users) and the Python `playwright` package, which drives that
# chromium over CDP. Never runs `playwright install`: no browser is downloaded from elsewhere.
# Idempotent: each part is skipped when already present. Needs root for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"

if [ ! -x /usr/bin/chromium ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-dejavu-core
fi

if ! "$PY" -c "import playwright" 2>/dev/null; then
    "$PY" -m pip install -q "playwright>=1.40"
fi

/usr/bin/chromium --version 2>/dev/null
"$PY" -c "import importlib.metadata as m; print('playwright', m.version('playwright'))"
