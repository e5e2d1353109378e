# The two commands that matter on a fresh machine: `make demo` and `make test`.
# Both create .venv, install the CPU build of torch when no NVIDIA GPU is present, then the project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenrelay-installed

.PHONY: demo test env clean-env

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: torch comes from the registry with CUDA"; \
	else \
		$(PY) -m pip install -q "torch==2.13.0"; \
	fi
	$(PY) -m pip install -q -e '.[worker,fetch,embedded,examples,gateway,dev]'
	touch $(STAMP)

demo: env
	$(PY) -m demos.service

# Two pytest workers, a file at a time (tests sharing a module fixture stay together): most
# tests wait on worker and redis-server processes, so two of them fit two cores.
test: env
	$(PY) -m pytest -q -n 2 --dist loadfile

clean-env:
	rm -rf $(VENV)
