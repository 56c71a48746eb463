#!/usr/bin/env bash
# The main job: install onceflow (first time only) and run the server.
# Arguments go to `onceflow serve` (see ./run.sh --help).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh runtime
exec .venv/bin/onceflow serve "$@"
