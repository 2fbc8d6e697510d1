#!/usr/bin/env bash
# The project's Dockerfile, built and run with Debian's podman, without a Docker
# engine and without pulling anything.
#
#   deploy/local/image.sh build   build ./Dockerfile as localhost/skillstats:test; prints the tag
#   deploy/local/image.sh base    only the base image (see below); prints its name
#   deploy/local/image.sh podman ARGS...   podman with this script's settings
#
# The Dockerfile's base is `debian:bookworm-slim` (its BASE argument). No registry
# can be reached here, so the base is made the way Debian's own images are: a
# `debootstrap --variant=minbase bookworm` root filesystem, imported once as
# localhost/skillstats-base:bookworm and passed as BASE; the Dockerfile itself is
# the one production builds. The machine's own CA certificates (the ones
# update-ca-certificates knows, /usr/local/share/ca-certificates) are added to
# that base only, so pip and apt inside RUN reach their mirrors through this
# machine's egress proxy; a production build from the real base needs nothing.
#
# Environment: SKILLSTATS_IMAGE (default localhost/skillstats:test),
# SKILLSTATS_STATE_DIR (default <repo>/.local). Needs root (podman's rootful
# storage) and installs podman, buildah, runc, catatonit and debootstrap when missing.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
state=${SKILLSTATS_STATE_DIR:-$repo/.local}
image=${SKILLSTATS_IMAGE:-localhost/skillstats:test}
base=localhost/skillstats-base:bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
export CONTAINERS_CONF=$here/image/containers.conf

log() { printf 'image.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

ensure_tools() {
  local missing=() tool
  for tool in podman buildah runc debootstrap; do command -v $tool >/dev/null || missing+=("$tool"); done
  # `podman kube play` starts each pod's infra container with catatonit
  [[ -x /usr/libexec/podman/catatonit || -x /usr/bin/catatonit ]] || missing+=(catatonit)
  ((${#missing[@]})) || return 0
  [[ $(id -u) -eq 0 ]] || die "podman's rootful storage is used here: run as root (missing: ${missing[*]})"
  log "installing Debian packages: ${missing[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

ensure_base() {
  podman image exists "$base" && return 0
  local root=$state/image-rootfs begin=$SECONDS
  log "making the base image $base (debootstrap --variant=minbase bookworm, about a minute, once)"
  rm -rf "$root"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$mirror" >"$state/debootstrap.log" 2>&1 \
    || die "debootstrap failed: $(tail -n1 "$state/debootstrap.log")"
  if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null 2>&1
  fi
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import --quiet - "$base" >/dev/null
  rm -rf "$root"
  log "base image made in $((SECONDS - begin))s"
}

build() {
  local begin=$SECONDS
  ensure_base
  log "building $image from ./Dockerfile"
  podman build --network host --build-arg "BASE=$base" -t "$image" -f "$repo/Dockerfile" "$repo" \
    >"$state/image-build.log" 2>&1 || die "podman build failed (log: $state/image-build.log): $(tail -n3 "$state/image-build.log")"
  log "built $image in $((SECONDS - begin))s ($(podman image inspect --format '{{.Size}}' "$image") bytes)"
  echo "$image"
}

mkdir -p "$state"
cmd=${1:-}
case $cmd in
  build) ensure_tools; build ;;
  base) ensure_tools; ensure_base; echo "$base" ;;
  podman) shift; exec podman "$@" ;;
  *) echo "usage: $0 build|base|podman ARGS..." >&2; exit 2 ;;
esac
