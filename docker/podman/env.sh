# Sourced by the image and container scripts: podman with the repo's settings, installed if
# missing (as root, from Debian's packages).
# shellcheck shell=bash
DISAGG_PODMAN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$DISAGG_PODMAN_DIR/containers.conf}"

ensure_podman() {
  local missing=()
  command -v podman >/dev/null || missing+=(podman)
  command -v runc >/dev/null || missing+=(runc)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "needs ${missing[*]}: apt-get install podman runc debootstrap (as root)" >&2
    return 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
}
