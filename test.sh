#!/usr/bin/env bash
# Every check onceflow has: lint (with a complexity bound), formatting, type check, the layers contract,
# the Durable Streams conformance suite, then the tests.
# Installs what is missing first. Extra arguments go to pytest (e.g. ./test.sh -k crash).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh dev
echo "== lint (ruff)"
.venv/bin/ruff check src tools tests scripts
echo "== format (ruff format --check)"
.venv/bin/ruff format --check src tools tests scripts
echo "== type check (mypy --strict)"
.venv/bin/mypy
echo "== layers (lint-imports; contracts in pyproject.toml, map in docs/architecture.md)"
.venv/bin/lint-imports
echo "== conformance"
.venv/bin/python scripts/conformance.py
echo "== tests (pytest)"
.venv/bin/python -m pytest "$@"
