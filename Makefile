# Every install step of the project lives here. `make demo` and `make test` work on a fresh machine
# with only python3 (>= 3.10) installed; torch is pinned by constraints.txt to the local CPU wheel.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.ferry-installed

.PHONY: demo test test-deps lint bench gpu-site clean

# uv installs the same pins (constraints.txt) and extras as pip would, in seconds instead of minutes. uv does not read
# pip's configuration: a machine's local wheel folder and index (PIP_FIND_LINKS / pip.conf's find-links,
# PIP_INDEX_URL) are handed to it, so the local CPU torch wheel is still the one taken.
EXTRAS     := test,metrics,gguf,quantization,predict,eval,lint
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_ENV     := $(if $(FIND_LINKS),UV_FIND_LINKS='$(FIND_LINKS)') $(if $(PIP_INDEX_URL),UV_INDEX_URL='$(PIP_INDEX_URL)')

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q 'uv>=0.9'
	$(UV_ENV) $(VENV)/bin/uv pip install -q --compile-bytecode --python $(VENV)/bin/python -c constraints.txt \
		--upgrade-package pip pip -e '.[$(EXTRAS)]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ferry demo

# The inspect tests render the approvers' HTML page in a real headless browser (Debian's chromium).
# The GGUF tests render Ollama's Modelfile TEMPLATE with Go's text/template (Debian's golang-go) and build
# llama-cpp-python once per machine from the pinned sdist (cmake, a C++ compiler; ninja when present).
# One apt-get update and one install for whatever is missing.
test-deps:
	missing="$$(command -v chromium >/dev/null || echo chromium) $$(command -v go >/dev/null || echo golang-go) \
		$$(command -v cmake >/dev/null || echo cmake) $$(command -v c++ >/dev/null || echo g++)"; \
	if [ -n "$$(echo $$missing)" ]; then apt-get update -qq && apt-get install -y -qq $$missing; fi

# The linters first: a tree that is not clean fails in a minute instead of after the suite. The project's own
# modules are compiled to bytecode first: the suite starts some 400 Python processes, and where
# PYTHONDONTWRITEBYTECODE is set (as on CI) each would otherwise compile ferry's sources again (~0.2 s each).
# Python checks each .pyc against its source's mtime and size, so an edited file is never run stale.
# The venv (uv) and the system packages (apt-get) are made at once: both wait on downloads more than on the CPU.
test:
	$(MAKE) -j2 $(STAMP) test-deps
	$(MAKE) lint
	$(VENV)/bin/python -m compileall -q -j 0 bundler trainer exporter ferry evaluation serving benchmarks tests
	$(VENV)/bin/python -m pytest

# ruff (lint and format) and mypy, configured in pyproject.toml. mypy's cache is one per machine (it checks each
# entry against the file's hash, so a fresh clone reuses what an earlier one checked: 3 s instead of 90 s).
MYPY_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ferry-tests/mypy

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	MYPY_CACHE_DIR='$(MYPY_CACHE)' $(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks

# The site folder a lent H100/H200 needs for benchmarks/gpu_check.py (what its image lacks, for Python 3.12 x86_64,
# unpacked; refused above 60 MiB); the device call names .gpu-site in carry. See gpu_check.py's docstring.
gpu-site: $(STAMP)
	$(VENV)/bin/python -m benchmarks.gpu_check --make-site .gpu-site

clean:
	rm -rf $(VENV) .pytest_cache
