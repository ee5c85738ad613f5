# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target operator -t disagg-operator/operator:0.1.0 .
#   docker build --target serving  -t disagg-operator/serving:0.1.0 .
# The operator image has no torch and no vLLM; the serving image is the official vLLM image
# plus kvhelper and the Mooncake transfer engine.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
# The Mooncake build that fits the base: CUDA here; `make images` builds on a CPU vLLM base
# and passes docker/serving-requirements-cpu.txt (docker/build-images.sh).
ARG SERVING_REQUIREMENTS=docker/serving-requirements.txt

# ---- operator: build a virtual environment, then copy only it into a clean base -------------
FROM ${PYTHON_IMAGE} AS operator-build
WORKDIR /src
COPY operator/ operator/
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --no-compile './operator[controller]'

FROM ${PYTHON_IMAGE} AS operator
COPY --from=operator-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# The distroless "nonroot" ids; the chart runs the pod with them and a read-only root.
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["disagg-operator"]
CMD ["run"]

# ---- serving: vLLM + kvhelper (connector, proxy, registry) + Mooncake ----------------------
FROM ${VLLM_IMAGE} AS serving
ARG SERVING_REQUIREMENTS
# libibverbs1: the Mooncake transfer engine links it even for TCP transport. The base image's
# Ubuntu release decides the exact version, so it is not pinned here.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/*
COPY ${SERVING_REQUIREMENTS} /tmp/serving-requirements.txt
COPY kvhelper/ /tmp/kvhelper/
RUN pip install --no-cache-dir -r /tmp/serving-requirements.txt /tmp/kvhelper \
    && rm -rf /tmp/kvhelper /tmp/serving-requirements.txt \
    && (getent passwd 1000 >/dev/null || useradd --uid 1000 --create-home --shell /usr/sbin/nologin vllm)
# The operator renders every serving container with runAsUser 1000 and its own command.
USER 1000
ENTRYPOINT []
CMD ["python3", "-m", "vllm.entrypoints.openai.api_server", "--help"]
