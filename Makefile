# Fresh machine: `make demo` (the CPU demo) and `make test` (the test suite). Both set up .venv first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.sparkrl-setup
PYTEST_ARGS ?=

.PHONY: setup demo test lint clean-venv

setup: $(STAMP)

# Re-runs only when pyproject.toml changes (or the venv is missing), so a second `make test` starts at once.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[cpu,test]"
	@# PyPI's torchvision/torchaudio/torchcodec are built against another torch and break
	@# `import transformers...` beside the +cpu torch: drop whichever of them cannot import.
	@for m in torchvision torchaudio torchcodec; do \
	  if $(BIN)/pip show -q $$m >/dev/null 2>&1 && ! $(BIN)/python -c "import $$m" >/dev/null 2>&1; then \
	    echo "setup: removing $$m (does not import beside this torch)"; $(BIN)/pip uninstall -y -q $$m; \
	  fi; \
	done
	@$(BIN)/python -c "import torch, transformers, vllm, verl, ray, peft; print('setup: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| verl', verl.__version__)"
	@touch $@

demo: setup
	$(BIN)/sparkrl train recipes/demo_cpu.yaml run.name=demo-$$(date +%Y%m%d-%H%M%S)

test: setup
	@# --durations: the slowest tests in every log, to keep CI (45 minutes at most) in view.
	$(BIN)/python -m pytest -m "not gpu" --durations=20 $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

clean-venv:
	rm -rf $(VENV)
