#!/usr/bin/env bash
# Builds the stand-in for python:3.11-slim from Debian's packages alone (no registry needed):
# debootstrap a minimal bookworm, then import it as an image.
#   docker/bases/python-base.sh IMAGE
# Skips the build when IMAGE exists and was made from this same script (label input-hash).
set -euo pipefail
image="$1"
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../podman/env.sh
source "$here/../podman/env.sh"
ensure_podman

hash="$(sha256sum "$0" | cut -c1-16)"
if [ "$(podman image inspect --format '{{index .Labels "input-hash"}}' "$image" 2>/dev/null)" = "$hash" ]; then
  echo "$image is up to date"
  exit 0
fi

# curl: podman runs a pod's httpGet probes as `curl` inside the container.
# libibverbs1: Mooncake's transfer engine links it even for TCP.
packages=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,libibverbs1,curl
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include="$packages" bookworm "$root" >/dev/null
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | podman import \
  --change 'CMD ["python3"]' \
  --change 'ENV LANG=C.UTF-8' \
  --change "LABEL input-hash=$hash" \
  - "$image" >/dev/null
echo "built $image"
