# quantd: API + workers in one image, on the torch release its test suite runs (TORCH_VERSION).
#   GPU (default): docker build -t quantd .
#     torch from PyPI, its CUDA 13.0 build (CUDA libraries included; the host needs the NVIDIA driver 580 or
#     later and the NVIDIA container toolkit). For an older driver, point TORCH_INDEX_URL at the PyTorch wheel
#     index of a CUDA build of this torch that the driver runs (pytorch.org's install selector lists them).
#   CPU only:      docker build -t quantd:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    QUANTD_DATA_DIR=/data \
    QUANTD_HOST=0.0.0.0 \
    QUANTD_PORT=8000

WORKDIR /app
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# A C/C++ compiler: the engine compiles its fused kernels with torch.compile, Inductor's C++ backend on the CPU
# and Triton on the GPU (which builds its launcher with the C compiler); without one it runs eager torch
# (slower, same results).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, so that its layer is cached across source changes; pinned by TORCH_VERSION (which the linter
# cannot read through the variable), and held there by a constraint when quantd's dependencies install.
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}" \
    && echo "torch==${TORCH_VERSION}" > /tmp/torch-constraint.txt

COPY pyproject.toml README.md ./
COPY client ./client
COPY service ./service
RUN pip install -c /tmp/torch-constraint.txt "/app[server,scale]" \
    && useradd --system --uid 10001 --create-home --home-dir /home/quantd quantd \
    && mkdir -p /data \
    && chown quantd:quantd /data

USER 10001:10001
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('QUANTD_PORT', '8000') + '/healthz', timeout=4).status == 200 else 1)"]

CMD ["quantd", "serve", "--host", "0.0.0.0"]
