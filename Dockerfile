# deviceplane: one image for the node agent, the operator and the reference plugins.
#   deviceplane agent ... | deviceplane operator ... | deviceplane plugin files|sim ...
# The base is any Debian bookworm image with python3 (3.11) and python3-venv; `scripts/build-image.sh` makes one
# with debootstrap when no registry is reachable and builds this file with buildah.
ARG BASE=docker.io/library/debian:bookworm-slim

FROM ${BASE} AS build
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null || ! python3 -c 'import ensurepip' 2>/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python3 -m venv /opt/deviceplane
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deviceplane ./deviceplane
RUN /opt/deviceplane/bin/pip install --no-cache-dir --disable-pip-version-check ".[cluster,operator]" \
    && /opt/deviceplane/bin/python -m compileall -q /opt/deviceplane

FROM ${BASE}
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=build /opt/deviceplane /opt/deviceplane
ENV PATH=/opt/deviceplane/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root by default (the operator). The agent and plugins write sockets into root-owned host directories: their
# manifests set runAsUser: 0 explicitly.
USER 65532:65532
ENTRYPOINT ["deviceplane"]
CMD ["--help"]
