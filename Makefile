# Two entry points for a fresh machine: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test lint clean

$(STAMP): operator/pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e 'operator[emulator]' -r requirements-dev.txt
	touch $(STAMP)

# The main job on the embedded default: render the seed 1P2D DeepSeek-V2-Lite deployment.
run: $(STAMP)
	$(VENV)/bin/disagg-operator render examples/deepseek-v2-lite-1p2d.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check operator tests
	$(VENV)/bin/mypy operator/src

clean:
	rm -rf $(VENV)
