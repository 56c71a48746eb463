#!/usr/bin/env bash
# Installs what onceflow needs into ./.venv (idempotent; quick when everything is there).
#   scripts/setup.sh        runtime: onceflow with PySpark, and Java if missing (for ./run.sh)
#   scripts/setup.sh ha     runtime plus what `onceflow demo --ha` needs: psycopg (onceflow[postgresql])
#                           and PostgreSQL's server binaries (Debian's postgresql package)
#   scripts/setup.sh dev    plus the dev tools (tools/: onceflow bench|chaos|sim), the test, lint and
#                           type-check tools, Node.js for conformance, and Patroni and etcd (chaos
#                           --failover-manager patroni)
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
extra="[spark]"  # the demo (the main job) runs a Spark pipeline
[ "$want" = ha ] && extra="[spark,postgresql]"
[ "$want" = dev ] && extra="[dev]"
stamp=".venv/.installed-$want"
# a dev install includes everything the runtime needs
if [ "$want" != dev ] && [ -f .venv/.installed-dev ] && [ ! pyproject.toml -nt .venv/.installed-dev ]; then
  stamp=.venv/.installed-dev
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || { [ "$want" = dev ] && [ tools/pyproject.toml -nt "$stamp" ]; }; then
  echo "setup: installing onceflow$extra into .venv"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".$extra"
  if [ "$want" = dev ]; then
    # the dev tools (onceflow bench|chaos|sim): a separate distribution, onceflow-tools, in tools/
    echo "setup: installing onceflow-tools (tools/) into .venv"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e tools
  fi
  touch "$stamp"
fi

apt_install() {  # Debian packages, as root or through sudo
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Spark needs a Java runtime (17 or newer)
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  echo "setup: Java is missing (Spark runs on it); installing openjdk-17-jre-headless from Debian's packages"
  apt_install openjdk-17-jre-headless
fi

# the dashboard's test loads /ui in a headless browser (tests/server/test_dashboard.py)
if [ "$want" = dev ] && ! command -v chromium >/dev/null 2>&1; then
  echo "setup: Chromium is missing (the dashboard's test runs it headless); installing from Debian's packages"
  apt_install chromium
fi

# a step of the database's clock (tests/storage/test_pgfs_clock_step.py) is made with libfaketime
if [ "$want" = dev ] && ! ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1; then
  echo "setup: libfaketime is missing (the clock-step test runs PostgreSQL under it); installing from Debian's packages"
  apt_install faketime
fi

# `onceflow chaos --store postgresql --failover-manager patroni` and its test (tests/tools/test_chaos_patroni.py)
# run the database as a Patroni cluster over etcd (docs/ha.md, "Running with Patroni")
if [ "$want" = dev ] && { ! command -v patroni >/dev/null 2>&1 || ! command -v etcd >/dev/null 2>&1; }; then
  echo "setup: Patroni or etcd is missing (the Patroni chaos test runs them); installing patroni and etcd-server from Debian's packages"
  apt_install patroni etcd-server
fi

if [ "$want" = dev ] && ! command -v npx >/dev/null 2>&1; then
  echo "setup: Node.js is missing (the conformance suite runs on it); installing from Debian's packages"
  apt_install nodejs npm
fi

# the official TypeScript client, for tests/interop/test_interop.py (pinned by .ci/ts-client/package-lock.json)
if [ "$want" = dev ] && [ ! -f .ci/ts-client/node_modules/@durable-streams/client/package.json ]; then
  echo "setup: installing @durable-streams/client into .ci/ts-client from npm"
  (cd .ci/ts-client && npm ci --no-audit --no-fund --loglevel=error)
fi

# --- sinks: the sink tests and `onceflow bench sinks` start throwaway PostgreSQL and Redis servers
# (onceflow.testing; never the ones on 5432/6379), so they need the server binaries; so does
# `onceflow demo --ha` (PostgreSQL only)
if [ "$want" = dev ] || [ "$want" = ha ]; then
  sink_pkgs=""
  have_initdb=0
  command -v initdb >/dev/null 2>&1 && have_initdb=1
  for bindir in "$(pg_config --bindir 2>/dev/null || true)" /usr/lib/postgresql/*/bin; do
    [ -n "$bindir" ] && [ -x "$bindir/initdb" ] && have_initdb=1
  done
  [ "$have_initdb" = 1 ] || sink_pkgs="$sink_pkgs postgresql"
  if [ "$want" = dev ] && ! command -v redis-server >/dev/null 2>&1; then
    sink_pkgs="$sink_pkgs redis-server"
  fi
  if [ -n "$sink_pkgs" ]; then
    echo "setup: the sink tests and demo --ha run PostgreSQL (and the sinks Redis); installing from Debian's packages:$sink_pkgs"
    # shellcheck disable=SC2086 # one word per package
    apt_install $sink_pkgs
  fi
fi
