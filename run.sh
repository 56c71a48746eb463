#!/usr/bin/env bash
# The main job: install onceflow with PySpark (first time only) and run the end-to-end exactly-once
# demo on the embedded default: a throwaway server, a producer whose acks are dropped, a Spark
# pipeline whose driver is killed and restarted, and a verification table.
# Arguments go to `onceflow demo` (see ./run.sh --help; ./run.sh --ha runs it highly available: two
# servers over a PostgreSQL primary and its standby). To run only the server: .venv/bin/onceflow serve
set -euo pipefail
cd "$(dirname "$0")"
want=runtime
for arg in "$@"; do [ "$arg" = --ha ] && want=ha; done  # --ha: PostgreSQL's binaries and psycopg too
scripts/setup.sh "$want"
exec .venv/bin/onceflow demo "$@"
