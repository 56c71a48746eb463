#!/usr/bin/env bash
# Installs what onceflow needs into ./.venv (idempotent; quick when everything is there).
#   scripts/setup.sh        runtime only (for ./run.sh)
#   scripts/setup.sh dev    plus the test, lint and type-check tools, and Node.js for conformance
set -euo pipefail
cd "$(dirname "$0")/.."
want=${1:-runtime}

py=""
for cand in python3.13 python3.12 python3.11 python3; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    py=$cand; break
  fi
done
if [ -z "$py" ]; then
  echo "setup: onceflow needs Python >= 3.11; none found on PATH" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
extra=""
[ "$want" = dev ] && extra="[dev]"
stamp=".venv/.installed-$want"
# a dev install includes everything the runtime needs
if [ "$want" = runtime ] && [ -f .venv/.installed-dev ] && [ ! pyproject.toml -nt .venv/.installed-dev ]; then
  stamp=.venv/.installed-dev
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing onceflow$extra into .venv"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".$extra"
  touch "$stamp"
fi

if [ "$want" = dev ] && ! command -v npx >/dev/null 2>&1; then
  echo "setup: Node.js is missing (the conformance suite runs on it); installing from Debian's packages"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
  fi
fi
