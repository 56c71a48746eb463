#!/usr/bin/env bash
# Every check onceflow has: lint, type check, the Durable Streams conformance suite, then the tests.
# Installs what is missing first. Extra arguments go to pytest (e.g. ./test.sh -k crash).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh dev
echo "== lint (ruff)"
.venv/bin/ruff check src tests scripts
echo "== type check (mypy --strict)"
.venv/bin/mypy
echo "== conformance"
.venv/bin/python scripts/conformance.py
echo "== tests (pytest)"
.venv/bin/python -m pytest "$@"
