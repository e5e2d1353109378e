# tokenrelay images: one Dockerfile, three targets (compose.yaml builds each one):
#
#   producer     tokenrelay submit/batch/... and tokenrelay gateway (OpenAI API):
#                pydantic, redis, fastapi; no torch (~200 MB)
#   worker-cpu   tokenrelay worker on CPU: torch from PyTorch's CPU index (no CUDA wheels), no triton
#   worker-cuda  tokenrelay worker on NVIDIA GPUs: torch with CUDA and triton, plus gcc and Python's
#                headers, because Triton compiles a small C launcher for each kernel the first time
#                it runs (a CUDA *runtime* image has no compiler and fails at the first step);
#                the build checks that toolchain (python -m tokenrelay.kernels.compile_check --launcher)
#
# Pins and why:
#   TORCH_VERSION 2.13.0   the torch the test suite runs (CPU build) and the GPU check targets.
#                          Its PyPI build is for CUDA 13.0 (NVIDIA driver >= 580); for an older
#                          driver build with --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
#   triton (torch's pin)   torch 2.13.0 requires triton==3.7.1 and torch.compile needs exactly
#                          the triton its torch was built with, so the gpu extra leaves the version
#                          to torch; our kernels also pass the CPU suite under triton 3.9 (interpreter)
#                          and compile to sm_90 cubins with the image's triton (compose-test checks)
#   PYTHON_VERSION 3.12    CPython with wheels for every dependency; any 3.10+ works
#
# Site extras (a TLS-intercepting proxy's CA, wheels for an offline build): docker/local/README.md.
ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY docker/local/ca/ /usr/local/share/ca-certificates/tokenrelay-local/
RUN update-ca-certificates >/dev/null 2>&1 || true; \
    useradd --create-home --uid 10001 tokenrelay

# Dependencies go into /opt/venv in build stages, from pyproject.toml and requirements.lock alone
# (an install of the project without its packages, every version the lock's: the set CI tested),
# so editing code rebuilds no dependency layer and the wheels of docker/local/wheels never reach
# a final image. PIP_CONSTRAINT applies the lock to every pip install below, build environments
# included; torch is not in it (each image picks its build).
FROM base AS deps
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_CONSTRAINT=/tmp/project/requirements.lock
COPY docker/local/wheels/ /tmp/wheels/
COPY pyproject.toml requirements.lock /tmp/project/
RUN touch /tmp/project/README.md          # pyproject names it; its text changes no dependency

# The project itself as one wheel (the tokenrelay namespace: pyproject.toml maps the design's
# folders into it), installed --no-deps into each image: its `tokenrelay` command is the entry
# point, and no folder of ours sits on a path where it could shadow another distribution.
FROM deps AS project-wheel
WORKDIR /src
COPY pyproject.toml requirements.lock README.md ./
COPY tokenrelay ./tokenrelay
COPY protocol ./protocol
COPY engine ./engine
COPY kernels ./kernels
COPY worker ./worker
COPY producer_sdk ./producer_sdk
RUN pip wheel --no-deps --find-links /tmp/wheels -w /wheel .

# Stage order matters to Docker's classic builder (no BuildKit), which builds every stage
# above the target: each image's stages come before the next image's, the CUDA ones last.
FROM deps AS deps-producer
RUN pip install --find-links /tmp/wheels "/tmp/project[gateway]" && pip uninstall -y tokenrelay

FROM base AS producer
COPY --from=deps-producer /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=project-wheel /wheel /tmp/wheel
RUN pip install --no-deps --no-compile /tmp/wheel/*.whl && rm -rf /tmp/wheel
WORKDIR /app
USER tokenrelay
EXPOSE 8000
ENTRYPOINT ["tokenrelay"]

FROM deps AS deps-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# +cpu exists only on the CPU index (or in docker/local/wheels): the CUDA build cannot slip in.
RUN pip install --find-links /tmp/wheels "torch==${TORCH_VERSION}+cpu" \
        --extra-index-url "${TORCH_INDEX_URL}" \
 && pip install --find-links /tmp/wheels "/tmp/project[worker,fetch]" \
 && pip uninstall -y tokenrelay

FROM base AS worker-cpu
COPY --from=deps-cpu /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH HF_HOME=/home/tokenrelay/.cache/huggingface
COPY --from=project-wheel /wheel /tmp/wheel
RUN pip install --no-deps --no-compile /tmp/wheel/*.whl && rm -rf /tmp/wheel
WORKDIR /app
# the mount point of compose's `models` volume: a new named volume takes this owner
RUN mkdir -p /models && chown tokenrelay /models
USER tokenrelay
EXPOSE 9400
ENTRYPOINT ["tokenrelay", "worker"]

FROM deps AS deps-cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
# no --find-links here: a local torch X+cpu wheel would satisfy torch==X (and win: it sorts higher)
# torch pins the triton it was built with: the lock's triton (the CPU interpreter's) is left out.
RUN grep -v '^triton==' /tmp/project/requirements.lock > /tmp/gpu.lock \
 && export PIP_CONSTRAINT=/tmp/gpu.lock \
 && pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
 && pip install "/tmp/project[worker,gpu,fetch]" && pip uninstall -y tokenrelay

FROM base AS worker-cuda
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=deps-cuda /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH HF_HOME=/home/tokenrelay/.cache/huggingface
COPY --from=project-wheel /wheel /tmp/wheel
RUN pip install --no-deps --no-compile /tmp/wheel/*.whl && rm -rf /tmp/wheel
WORKDIR /app
RUN python -m tokenrelay.kernels.compile_check --launcher
USER tokenrelay
EXPOSE 9400
ENTRYPOINT ["tokenrelay", "worker"]
