# tensorswap: the two set-up commands are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP_CORE := $(VENV)/.installed-core
STAMP_DEV := $(VENV)/.installed-dev

.PHONY: demo test check bench format clean flower-venv flower-test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP_CORE): pyproject.toml setup.py src/tensorswap/aggregate/server_opt/_fused.c src/tensorswap/privacy/secagg/_quantize.c src/tensorswap/_native/widths.h | $(PY)
	$(PY) -m pip install --quiet -e '.[demo]'
	touch $@

$(STAMP_DEV): pyproject.toml setup.py src/tensorswap/aggregate/server_opt/_fused.c src/tensorswap/privacy/secagg/_quantize.c src/tensorswap/_native/widths.h | $(PY)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@ $(STAMP_CORE)

demo: $(STAMP_CORE)
	$(VENV)/bin/tensorswap demo

test: $(STAMP_DEV)
	$(PY) -m pytest
	$(MAKE) flower-test

check: $(STAMP_DEV)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

format: $(STAMP_DEV)
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

bench: $(STAMP_DEV)
	$(PY) -m benchmarks

# Flower 1.42 in a venv of its own, for the benchmarks that run it beside tensorswap
# (benchmarks/_flower.py finds it); never a dependency of tensorswap.
# `make flower-test` runs tests/flower/ there (about 45 s to build the venv, 45 s to test).
flower-venv: .venv-flower/.installed

.venv-flower/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv .venv-flower
	.venv-flower/bin/pip install --quiet 'flwr[simulation]==1.42.0' numpy \
		pytest pytest-asyncio pytest-timeout hypothesis
	.venv-flower/bin/pip install --quiet -e .
	touch $@

flower-test: flower-venv
	cd tests && PYTHONPATH=$(CURDIR)/tests/flower ../.venv-flower/bin/python -m pytest flower

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
	find src -name '*.so' -delete
