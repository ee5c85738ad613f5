#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_kv_check.py) on a machine with a CUDA GPU and PyTorch but no
# package index: fetch the Mooncake wheel and the RDMA libraries it links here, carry the folder
# .gpu-deps (ignored by git) there, and run.
#
#   bash benchmarks/gpu_kv_check.sh fetch            # here: fills .gpu-deps
#   bash benchmarks/gpu_kv_check.sh run OUT_DIR      # there, from the repository's root
#
# PYTHON (default python3) is the Python that holds PyTorch there; the wheel is fetched for
# its version (PYTHON_VERSION, default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
DEPS=.gpu-deps
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1

case "${1:-}" in
fetch)
    mkdir -p "$DEPS"
    python3 -m pip download --no-deps --only-binary=:all: \
        --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEPS" "$MOONCAKE"
    (cd "$DEPS" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200)
    ls -l "$DEPS"
    ;;
run)
    out=${2:?usage: gpu_kv_check.sh run OUT_DIR}
    python=${PYTHON:-python3}
    if ! "$python" -c "import mooncake.store" 2>/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-site \
            "$DEPS"/*.whl
        export PYTHONPATH=/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    if ! ldconfig -p | grep -q libibverbs.so.1; then
        for deb in "$DEPS"/*.deb; do dpkg -x "$deb" /tmp/gpu-libs; done
        export LD_LIBRARY_PATH=/tmp/gpu-libs/usr/lib/x86_64-linux-gnu:/tmp/gpu-libs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    PYTHONUNBUFFERED=1 exec "$python" benchmarks/gpu_kv_check.py --out "$out" "${@:3}"
    ;;
*)
    echo "usage: $0 fetch | run OUT_DIR [gpu_kv_check.py options]" >&2
    exit 2
    ;;
esac
