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

# The main job on the embedded default: the operator reconciles the seed 1P2D DeepSeek-V2-Lite
# DisaggServing in the embedded API emulator (kubectl apply, wait for Ready, show the result).
run: $(STAMP)
	$(VENV)/bin/disagg-operator demo examples/deepseek-v2-lite-1p2d.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check operator tests benchmarks
	$(VENV)/bin/mypy operator/src

clean:
	rm -rf $(VENV)
