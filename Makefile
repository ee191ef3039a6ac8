# The two commands of README.md, on a fresh clone where only python3 exists:
#   make tune   set up .venv on first use, then `gdr-dispatch tune` on this machine's default grid
#   make test   the same set-up, then the test suite without the `slow` cases (.ci/run runs it, then those)
# torch: a torch python3 can already import is used as it is (a GPU machine's CUDA build);
# otherwise the CPU wheel torch==$(TORCH_CPU) is installed into .venv.

PYTHON ?= python3
VENV ?= .venv
TORCH_CPU ?= 2.13.0
BIN := $(VENV)/bin

.PHONY: tune test env clean-env

tune: env
	$(BIN)/gdr-dispatch tune

test: env
	$(BIN)/python -m pytest -q

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "using the torch $(PYTHON) already imports"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && $(BIN)/python -m pip install -q "torch==$(TORCH_CPU)"; \
	fi
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $@

clean-env:
	rm -rf $(VENV)
