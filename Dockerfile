# tokenrelay worker image. `--build-arg DEVICE=cpu` builds the CPU-only variant.
ARG DEVICE=cuda

# CUDA variant: torch and triton come with the base image.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime AS base-cuda
ENV TORCH_INSTALL=""

# CPU variant: torch from PyTorch's CPU index (no CUDA wheels).
FROM python:3.11-slim AS base-cpu
ENV TORCH_INSTALL="torch --index-url https://download.pytorch.org/whl/cpu"

FROM base-${DEVICE}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN useradd --create-home --uid 10001 tokenrelay
WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY worker ./worker
COPY producer_sdk ./producer_sdk
RUN if [ -n "$TORCH_INSTALL" ]; then pip install $TORCH_INSTALL; fi \
 && pip install ".[worker,gateway]"
USER tokenrelay
ENV HF_HOME=/home/tokenrelay/.cache/huggingface
EXPOSE 9400 8000
ENTRYPOINT ["python", "-m", "worker"]
