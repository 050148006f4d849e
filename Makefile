# Two commands for a newcomer: `make run` starts keyveil, `make test` runs every test.
# Only Python 3.12 is needed beforehand; everything else is installed into .venv.

PYTHON ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test soak bench clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "make: Python 3.12 not found; install it or pass PYTHON=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	@touch $@

install: $(STAMP)

run: $(STAMP)
	$(BIN)/keyveil init
	$(BIN)/keyveil start

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q

soak: $(STAMP)
	$(BIN)/python -m pytest -q -m soak -p no:randomly

bench: $(STAMP)
	$(BIN)/python bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
