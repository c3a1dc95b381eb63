#!/usr/bin/env bash
# Start a throwaway PostgreSQL cluster for the tests and print its URL on stdout.
# As root, initdb/pg_ctl refuse to run directly; Debian's cluster scripts run them as the postgres user.
set -euo pipefail
VERSION=${PG_VERSION:-$(ls /usr/lib/postgresql | sort -n | tail -1)}
NAME=${PG_CLUSTER:-spillway_ci}
PORT=${PG_PORT:-54329}
DATA=${PG_DATA:-/tmp/spillway-pg-$PORT}
if pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$VERSION $NAME" && [ ! -f "$DATA/PG_VERSION" ]; then
  pg_dropcluster --stop "$VERSION" "$NAME" >&2 || true   # its data went with /tmp: start over
fi
if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$VERSION $NAME"; then
  rm -rf "$DATA"
  pg_createcluster "$VERSION" "$NAME" --port "$PORT" --datadir "$DATA" \
    -- --auth-local=trust --auth-host=trust >&2
fi
pg_ctlcluster "$VERSION" "$NAME" start >&2 2>/dev/null || true
for _ in $(seq 1 60); do
  pg_isready -h 127.0.0.1 -p "$PORT" -q && break
  sleep 0.5
done
pg_isready -h 127.0.0.1 -p "$PORT" -q || { echo "PostgreSQL did not come up on port $PORT" >&2; exit 1; }
runuser -u postgres -- psql -h 127.0.0.1 -p "$PORT" -qAtc "SELECT 1 FROM pg_database WHERE datname='spillway_test'" | grep -q 1 \
  || runuser -u postgres -- createdb -h 127.0.0.1 -p "$PORT" spillway_test >&2
echo "postgresql://postgres@127.0.0.1:$PORT/spillway_test"
