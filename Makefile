# The two commands that matter on a fresh machine: `make demo` and `make test`.
# Both create .venv and install torch for this machine (the CUDA build and triton when an NVIDIA
# GPU answers, else the CPU build from PyTorch's CPU index), then the project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenrelay-installed
# The torch the project is tested with (CPU here; the GPU image pins the same, see Dockerfile).
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS ?= worker,fetch,embedded,examples,gateway,dev
# make gpu-check: the interpreter of the GPU machine (torch, triton, transformers preinstalled)
PYTHON ?= python3
GPU_WHEELS ?= .gpu-wheels
GPU_CHECK_OUT ?= gpu-check-report

.PHONY: demo test env clean-env gpu-wheels gpu-check compose-test

env: $(STAMP)

# CPU: torch==X+cpu exists only on PyTorch's CPU index (or a local wheel pip's config finds), so
# the CUDA build can never be picked by mistake. The configured indexes and local wheels are tried
# first: a machine that cannot reach PyTorch's index would otherwise retry it for every dependency.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: torch $(TORCH_VERSION) with CUDA from the default index, and triton"; \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)" && \
		$(PY) -m pip install -q -e '.[$(EXTRAS),gpu]'; \
	else \
		echo "no NVIDIA GPU: the CPU build of torch $(TORCH_VERSION)"; \
		{ $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
		  $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(TORCH_CPU_INDEX); } && \
		$(PY) -m pip install -q -e '.[$(EXTRAS)]'; \
	fi
	touch $(STAMP)

demo: env
	$(PY) -m demos.service

# Two pytest workers, a file at a time (tests sharing a module fixture stay together): most
# tests wait on worker and redis-server processes, so two of them fit two cores.
test: env
	$(PY) -m pytest -q -n 2 --dist loadfile

clean-env:
	rm -rf $(VENV)

# Wheels the GPU check needs beyond torch, triton and transformers, for CPython 3.12 manylinux
# x86_64, into $(GPU_WHEELS)/ (ignored by git); copy the folder with the repository.
gpu-wheels:
	$(PYTHON) -m benchmarks.gpu_wheels download $(GPU_WHEELS)

# On the GPU machine, nothing fetched: installs what is missing from $(GPU_WHEELS)/ (--no-index),
# then writes report.json and report.txt into $(GPU_CHECK_OUT)/.
gpu-check:
	$(PYTHON) -m benchmarks.gpu_check --out $(GPU_CHECK_OUT) --wheels $(GPU_WHEELS)

# Opt-in, not part of `make test`: builds the images and runs compose.yaml's services with Docker
# (a private dockerd when DOCKER_HOST is unset; needs root). See tests/e2e/test_compose_stack.py.
compose-test: env
	$(PY) -m pip install -q -e '.[compose]'
	TOKENRELAY_COMPOSE_TEST=1 $(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_compose_stack.py
