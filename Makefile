# Two commands do everything: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
TORCH  := torch==2.13.0
DEMO   := demo_checkpoints
NOTEBOOK_COPIES := $(patsubst notebooks/%,$(DEMO)/notebooks/%,$(wildcard notebooks/*.ipynb))
# Byte-compiled once, as a wheel install would be: where PYTHONDONTWRITEBYTECODE is set,
# an editable install would otherwise compile every module in every new process.
COMPILE := $(PY) -m compileall -q inspector
# JupyterLab refuses to start as root (containers, CI machines) unless told it is fine.
LAB_FLAGS := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: test fuzz demo dev-env lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
dev-env: $(PY)
	$(PIP) $(TORCH)
	$(PIP) -e '.[dev]'
	$(COMPILE)

test: dev-env
	$(PY) -m ruff check inspector tests benchmarks
	$(PY) -m mypy
	$(PY) -m pytest

# Many more fuzz examples than `make test` runs, with a fresh seed each time; the native
# decoders' sanitized (ASan+UBSan) structure-aware pass for FUZZ_SECONDS, then coverage-guided
# fuzzing (libFuzzer via atheris, clang's counters in the C code) of each native entry for
# FUZZ_SECONDS/3 each (tests/native/). clang (apt-get, as root) and atheris when missing.
FUZZ_SECONDS ?= 600
fuzz: dev-env
	FUZZ_PROFILE=fuzz $(PY) -m pytest tests/test_fuzz.py tests/test_fuzz_structure.py
	SANITIZED_FUZZ_SECONDS=$(FUZZ_SECONDS) SANITIZED_FUZZ_SEED=random $(PY) -m pytest tests/native/test_sanitized.py
	command -v clang >/dev/null || apt-get install -y clang
	$(PY) -c 'import atheris' 2>/dev/null || $(PIP) atheris==3.0.0
	GUIDED_FUZZ_SECONDS=$$(( $(FUZZ_SECONDS) / 3 )) GUIDED_TARGETS=metadata,opscan,table \
		$(PY) -m pytest tests/native/test_guided.py

# JupyterLab at the repository root (demo_checkpoints/ in view) on working copies of the
# notebooks, so what it autosaves stays out of notebooks/ (committed without outputs).
demo: $(DEMO)/.built $(NOTEBOOK_COPIES)
	INSPECTOR_DEMO_DIR=$(abspath $(DEMO)) $(VENV)/bin/jupyter lab $(LAB_FLAGS) \
		--ServerApp.root_dir=$(CURDIR) $(DEMO)/notebooks/inspect.ipynb

$(DEMO)/notebooks/%.ipynb: notebooks/%.ipynb
	mkdir -p $(@D)
	cp $< $@

$(DEMO)/.built: $(PY) pyproject.toml $(wildcard inspector/demo/*.py) $(shell find inspector -name '*.c')
	$(PIP) $(TORCH)
	$(PIP) -e '.[hf]'
	$(COMPILE)
	$(PY) -m inspector.demo $(DEMO)
	touch $@

lint: dev-env
	$(PY) -m ruff check inspector tests benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .ruff_cache .hypothesis
