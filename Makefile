# The two commands that matter on a fresh machine: `make demo` and `make test`.
# Both create .venv and install torch for this machine (the CUDA build and triton when an NVIDIA
# GPU answers, else the CPU build from PyTorch's CPU index), then the project with exactly the
# versions requirements.lock names (the set CI tested; `make lock` refreshes it on purpose).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenrelay-installed
# The torch the project is tested with (CPU here; the GPU image pins the same, see Dockerfile).
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS ?= worker,fetch,embedded,examples,gateway,dev
# The pins every install takes (pip constraints: they pin what is installed, they install nothing
# themselves). LOCK= (empty) installs the newest releases instead: `make test-latest`, `make lock`.
LOCK ?= requirements.lock
CONSTRAINTS = $(if $(LOCK),-c $(LOCK))
# make gpu-check: the interpreter of the GPU machine (torch, triton, transformers preinstalled)
PYTHON ?= python3
GPU_WHEELS ?= .gpu-wheels
GPU_CHECK_OUT ?= gpu-check-report
LATEST_VENV ?= .venv-latest

.PHONY: demo test env clean-env gpu-wheels gpu-check compose-test lock test-latest

env: $(STAMP)

# CPU: torch==X+cpu exists only on PyTorch's CPU index (or a local wheel pip's config finds), so
# the CUDA build can never be picked by mistake. The configured indexes and local wheels are tried
# first: a machine that cannot reach PyTorch's index would otherwise retry it for every dependency.
# GPU: torch pins the triton it was built with, so the lock's triton (the CPU interpreter's) is
# left out there ($(VENV)/gpu.lock).
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel $(CONSTRAINTS)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: torch $(TORCH_VERSION) with CUDA from the default index, and triton"; \
		$(if $(LOCK),grep -v '^triton==' $(LOCK) > $(VENV)/gpu.lock &&,) \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(if $(LOCK),-c $(VENV)/gpu.lock) && \
		$(PY) -m pip install -q -e '.[$(EXTRAS),gpu]' $(if $(LOCK),-c $(VENV)/gpu.lock); \
	else \
		echo "no NVIDIA GPU: the CPU build of torch $(TORCH_VERSION)"; \
		{ $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" $(CONSTRAINTS) 2>/dev/null || \
		  $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" $(CONSTRAINTS) --extra-index-url $(TORCH_CPU_INDEX); } && \
		$(PY) -m pip install -q -e '.[$(EXTRAS)]' $(CONSTRAINTS); \
	fi
	touch $(STAMP)

demo: env
	$(PY) -m demos.service

# Three pytest workers, a file at a time (tests sharing a module fixture stay together): most
# tests wait on worker and redis-server processes, so on two cores a third fills the idle time
# (a fresh clone, 2026-12-06: 11 min 52 s with three, 14 min 35 s with two; the cores were busy
# 67% of the run with two).
test: env
	$(PY) -m pytest -q -n 3 --dist loadfile

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

# The suite against the newest release of every dependency (no lock), in $(LATEST_VENV): what a
# user who installs the library into a fresh environment of their own gets today.
test-latest:
	rm -rf $(LATEST_VENV)
	$(MAKE) test VENV=$(LATEST_VENV) LOCK=

# Refresh requirements.lock on purpose: the newest releases, kept only when the whole suite passes
# with them (torch is left out: `make env` picks its build). Review the diff, then commit it.
lock: test-latest
	{ echo "# Versions CI tested (make lock, $$(date -u +%Y-%m-%d), Python $$($(LATEST_VENV)/bin/python -c 'import platform; print(platform.python_version())')): pip constraints for"; \
	  echo "# make env and the Docker images. torch is not here: make env picks its CPU or CUDA build."; \
	  $(LATEST_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v '^torch=='; } > requirements.lock
	@echo "requirements.lock refreshed; git diff requirements.lock shows what moved"
