# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
OUT    ?= out/demo

.PHONY: install demo test test-slow test-all unit clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: 2.13.0 resolves to the CPU build on the dev machines.
	$(BIN)/pip install --quiet torch==2.13.0
	# Editable: setuptools' import finder maps diloco.storage to storage/ and so on (pyproject.toml).
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: install
	$(BIN)/diloco demo --out $(OUT)

# The suite less the tests marked slow (benchmark harnesses, long trained runs): under 8 minutes.
test: install
	$(BIN)/pytest -m "not slow"

# Only the tests marked slow: CI runs them after `make test`.
test-slow: install
	$(BIN)/pytest -m slow

# Every test: `make test`, then the slow ones.
test-all: test test-slow

unit: install
	$(BIN)/pytest tests/unit

clean:
	rm -rf $(VENV) out .pytest_cache
