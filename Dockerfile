# quantd: API + workers in one image.
#   GPU (default): docker build -t quantd .
#   CPU only:      docker build -t quantd:cpu --build-arg BASE_IMAGE=python:3.11-slim \
#                    --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
# The PyTorch base already ships torch with CUDA; on the slim base torch comes from TORCH_INDEX_URL.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

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

# A C++ compiler: on CPU the engine compiles its fused kernels with torch.compile (Inductor's C++
# backend); without one it falls back to eager torch (slower, same results). GPU workers do not need it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first (only when the base has none), so the layer is cached across source changes.
RUN if ! python -c "import torch" 2>/dev/null; then \
        pip install --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" "torch>=2.4,<3"; \
    fi

COPY pyproject.toml README.md ./
COPY client ./client
COPY service ./service
RUN pip install "/app[server,scale]" \
    && useradd --system --uid 10001 --create-home --home-dir /home/quantd quantd \
    && mkdir -p /data \
    && chown quantd:quantd /data

USER 10001:10001
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('QUANTD_PORT', '8000') + '/healthz', timeout=4).status == 200 else 1)"]

CMD ["quantd", "serve", "--host", "0.0.0.0"]
