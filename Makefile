# Every install step of the project lives here. `make demo` and `make test` work on a fresh machine
# with only python3 (>= 3.10) installed; torch is pinned by constraints.txt to the local CPU wheel.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.ferry-installed

.PHONY: demo test test-deps lint bench gpu-site clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test,metrics,gguf,quantization,predict,eval,lint]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ferry demo

# The inspect tests render the approvers' HTML page in a real headless browser (Debian's chromium).
# The GGUF tests render Ollama's Modelfile TEMPLATE with Go's text/template (Debian's golang-go) and build
# llama-cpp-python once per machine from the pinned sdist (cmake, a C++ compiler; ninja when present).
test-deps:
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	command -v go >/dev/null || (apt-get update -qq && apt-get install -y -qq golang-go)
	command -v cmake >/dev/null && command -v c++ >/dev/null || (apt-get update -qq && apt-get install -y -qq cmake g++)

# The linters first: a tree that is not clean fails in a minute instead of after the suite.
test: $(STAMP) test-deps lint
	$(VENV)/bin/python -m pytest

# ruff (lint and format) and mypy, configured in pyproject.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks

# The site folder a lent H100/H200 needs for benchmarks/gpu_check.py (what its image lacks, for Python 3.12 x86_64,
# unpacked; refused above 60 MiB); the device call names .gpu-site in carry. See gpu_check.py's docstring.
gpu-site: $(STAMP)
	$(VENV)/bin/python -m benchmarks.gpu_check --make-site .gpu-site

clean:
	rm -rf $(VENV) .pytest_cache
