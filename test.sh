#!/usr/bin/env bash
# Every check onceflow has: lint (with a complexity bound), formatting, type check, the layers contract,
# the Durable Streams conformance suite on both stores (local disk, PostgreSQL), then the tests, and the
# in-process server's semantic tests again on the PostgreSQL store.
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
echo "== conformance (local store)"
.venv/bin/python scripts/conformance.py
echo "== conformance (PostgreSQL store)"
.venv/bin/python scripts/conformance.py --store postgresql
echo "== conformance (PostgreSQL store, through a follower that passes requests on to the leader)"
.venv/bin/python scripts/conformance.py --store postgresql --via-follower
echo "== tests (pytest)"
.venv/bin/python -m pytest --durations=20 "$@"  # the 20 slowest: where CI's time goes
echo "== the in-process server's tests again, on the PostgreSQL store (ONCEFLOW_TEST_STORE=postgresql)"
ONCEFLOW_TEST_STORE=postgresql .venv/bin/python -m pytest -q "$@"
