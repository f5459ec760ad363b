# The two commands of the README: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is pinned exactly: 2.13.0 is the CPU build on disk; a looser range pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
NATIVE_SOURCES := $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/*/*.cuh)

.PHONY: demo test install bench bench-compare lint clean

$(VENV)/.deps: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH)" "setuptools>=68" wheel "pybind11>=2.12" "numpy>=1.24"
	$(PIP) install -q --no-build-isolation -e ".[test]"
	touch $@

# Rebuild the extension whenever a native source changes.
$(VENV)/.native: $(VENV)/.deps $(NATIVE_SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.native

demo: install
	$(PY) -m clusterlm demo

test: install
	$(PY) -m pytest -q tests

bench: install
	$(PIP) install -q -e ".[bench]"
	$(PY) benchmarks/compare_kmeans.py
	$(PY) benchmarks/bench_token_balance.py
	$(PY) benchmarks/render_benchmarks.py

# The end-to-end selection benchmark (all methods through the trainer, 3 seeds): over an hour on 2 cores.
bench-compare: install
	$(PY) benchmarks/bench_compare.py
	$(PY) benchmarks/render_benchmarks.py

lint: install
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check .

clean:
	rm -rf build $(VENV) *.egg-info cluster_kernels/_C*.so
