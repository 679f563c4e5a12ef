#!/usr/bin/env bash
# Installs (if needed) and starts a throwaway PostgreSQL server on loopback for the Postgres tests.
# Prints the connection URL on stdout; everything else goes to stderr.
set -euo pipefail
PORT=${SMOLGYM_PG_PORT:-55432}
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2
fi
BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/pg_ctl | sort -V | tail -n 1)")
DATA=$(mktemp -d /tmp/smolgym-pg.XXXXXX)
chown postgres:postgres "$DATA"
su postgres -s /bin/sh -c "$BIN/initdb -D $DATA -A trust -U postgres >/dev/null" >&2
su postgres -s /bin/sh -c "$BIN/pg_ctl -D $DATA -o '-p $PORT -k /tmp -c listen_addresses=127.0.0.1' -l $DATA/log -w start" >&2
su postgres -s /bin/sh -c "$BIN/psql -h 127.0.0.1 -p $PORT -U postgres -c 'CREATE DATABASE smolgym_test'" >&2
echo "postgresql://postgres@127.0.0.1:$PORT/smolgym_test"
