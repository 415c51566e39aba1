# Two commands do all set-up on a fresh machine:
#   make quickstart   install, then run the main job on its embedded default (CPU)
#   make test         install, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup quickstart test test-gpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first: a later unpinned request must not pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

quickstart: setup
	$(VENV)/bin/harness info jobs/quickstart.yaml
	$(VENV)/bin/harness run jobs/quickstart.yaml

test: setup
	@# a real single-node Slurm for tests/slurm (Debian packages; needs root): skipped, not failed, without it
	@bash slurm/local/cluster.sh install >/dev/null 2>&1 || echo "note: Slurm not installable here; tests/slurm will skip"
	@# passwordless ssh to 127.0.0.1:2222 and pdsh, for the deepspeed launcher's pdsh mode (needs root): skipped without
	@bash scripts/loopback_ssh.sh start >/dev/null 2>&1 || echo "note: no loopback ssh here; the pdsh-mode test will skip"
	@# two workers (pytest-xdist), a file's tests on one of them; tests/conftest.py groups the files that must not overlap
	$(PY) -m pytest -q -n 2 --dist loadgroup

test-gpu: setup
	$(PY) -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) .pytest_cache
