#!/usr/bin/env bash
# Installs (if needed) and starts a throwaway PostgreSQL server on a free loopback port for the
# Postgres tests. Prints two lines on stdout: the connection URL, then the command that stops it.
set -euo pipefail
PORT=${SMOLGYM_PG_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
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
echo "su postgres -s /bin/sh -c '$BIN/pg_ctl -D $DATA -m fast stop' >/dev/null 2>&1; rm -rf $DATA"
