# Two commands set everything up on a fresh Linux machine with Python 3.11:
#   make train   installs into .venv and trains the tiny Llama on the embedded corpus (CPU)
#   make test    installs into .venv and runs the test suite
#   make test-fast   the tests that start no torch process (pytest -m "not slow"): under 2 minutes
#   make bench ARGS="step --threads 1"   a benchmark of bench.py through .venv (docs/benchmarks.md)
#   make clean   removes .venv and .cache (what make built); keeps out/, your runs
#   make help    this list (also plain `make`, which installs nothing)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: help train test test-fast bench install clean
.DEFAULT_GOAL := help

help:
	@sed -n '/^#/!q; s/^# \{0,1\}//p' $(firstword $(MAKEFILE_LIST))

$(STAMP): requirements.txt requirements-dev.txt requirements-torch.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-torch.txt
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# shellcheck (Debian) lints the trn1 launch scripts; its test skips, saying why, where apt is not ours.
test: $(STAMP)
	@command -v shellcheck >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && apt-get install -y -qq shellcheck) >/dev/null 2>&1; } || true
	$(PY) -m pytest -q tests $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests $(ARGS)

bench: $(STAMP)
	$(PY) bench.py $(ARGS)

# out/ holds the runs' checkpoints and exports (days of training, perhaps): never deleted by a target
# that says "clean" of itself; the user removes it by name.
clean:
	rm -rf $(VENV) .cache
	@[ ! -e out ] || echo "make clean: kept out/ (your runs' checkpoints and exports); rm -rf out deletes them"

