#!/usr/bin/env bash
# A local PostgreSQL server from Debian's packages, on a loopback port, for
# development and tests. Installs the `postgresql` package when no server
# binaries are present (needs root, or sudo).
#
#   deploy/local/postgres.sh start    initialise (once) and start; prints the database URL
#   deploy/local/postgres.sh stop     fast shutdown
#   deploy/local/postgres.sh url      print the SQLAlchemy URL of the server
#   deploy/local/postgres.sh status   exit 0 when running
#
# Environment: PG_PORT (default 55432), SKILLSTATS_STATE_DIR (default <repo>/.local),
# PG_PORT_SETTING (the variable a taken port's one line names; default PG_PORT,
# deploy/local/test.sh sets SKILLSTATS_TEST_PG_PORT).
#
# Tuned for throwaway data: fsync and synchronous_commit are off, which a crash of
# the *server* could punish but a kill -9 of a client cannot. Never point this
# script's settings at data you want to keep.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$here/lib.sh"
state=${SKILLSTATS_STATE_DIR:-$repo/.local}
port=${PG_PORT:-55432}
dir=$state/pg-$port
setting=${PG_PORT_SETTING:-PG_PORT}

log() { printf 'postgres.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

bin_dir() {
  local found
  found=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
  [[ -n $found && -x $found/initdb ]] && echo "$found"
}

install_server() {
  log "no PostgreSQL server found; installing Debian's postgresql package"
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo=sudo
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends postgresql >/dev/null
}

# PostgreSQL refuses to run as root: when we are root, the server runs as the
# `postgres` user the Debian package creates.
as_owner() {
  if [[ $(id -u) -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

url() { echo "postgresql://postgres@127.0.0.1:$port/postgres"; }

running() { [[ -f $dir/postmaster.pid ]] && as_owner "$(bin_dir)/pg_ctl" -D "$dir" status >/dev/null 2>&1; }

start() {
  local bin
  bin=$(bin_dir) || { install_server; bin=$(bin_dir) || die "postgresql installed but no initdb found"; }
  if [[ $(id -u) -eq 0 ]]; then
    # The server user must be able to reach its data folder; a checkout under a
    # private home folder is not, so fall back to /tmp there.
    mkdir -p "$state"
    if ! runuser -u postgres -- test -x "$state"; then dir=/tmp/skillstats-pg-$port; fi
  fi
  if running; then log "already running on 127.0.0.1:$port"; url; return 0; fi
  # Said in one line, before anything is written: another PostgreSQL of this machine (or any program)
  # on the port would otherwise make pg_ctl fail with the server's log.
  if port_in_use "$port"; then die "$(port_taken "PostgreSQL's port" "$port" "$setting")"; fi
  if [[ ! -f $dir/PG_VERSION ]]; then
    mkdir -p "$dir"
    [[ $(id -u) -eq 0 ]] && chown postgres: "$dir"
    chmod 700 "$dir"
    as_owner "$bin/initdb" -D "$dir" -U postgres -A trust --no-sync -E UTF8 >"$dir.initdb.log" 2>&1 \
      || { cat "$dir.initdb.log" >&2; die "initdb failed"; }
    cat >>"$dir/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 200
EOF
  fi
  local logged=0
  [[ -f $dir/server.log ]] && logged=$(stat -c %s "$dir/server.log")
  if ! as_owner "$bin/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 start >/dev/null 2>"$dir.start.log"; then
    # Taken between the check and the start, or bound without listening: this start's bind error says so.
    if tail -c +$((logged + 1)) "$dir/server.log" | grep -q "could not bind .*Address already in use"; then
      die "$(port_taken "PostgreSQL's port" "$port" "$setting")"
    fi
    cat "$dir.start.log" >&2
    tail -n 30 "$dir/server.log" >&2
    die "PostgreSQL did not start"
  fi
  log "PostgreSQL running on 127.0.0.1:$port (data in $dir)"
  url
}

stop() {
  [[ -d /tmp/skillstats-pg-$port && ! -d $dir ]] && dir=/tmp/skillstats-pg-$port
  if running; then as_owner "$(bin_dir)/pg_ctl" -D "$dir" -m fast -w stop >/dev/null; log "stopped"; fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  url) url ;;
  status) [[ -d /tmp/skillstats-pg-$port && ! -d $dir ]] && dir=/tmp/skillstats-pg-$port; running ;;
  *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
