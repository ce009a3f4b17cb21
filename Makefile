# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
OUT    ?= out/demo

.PHONY: install demo test test-all unit clean

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

# Every test, the slow ones included: what CI runs after `make test`.
test-all: install
	$(BIN)/pytest

unit: install
	$(BIN)/pytest tests/unit

clean:
	rm -rf $(VENV) out .pytest_cache
