# Two entry points a new user needs: `make demo` (set up, run the main job) and `make test`.
# The virtual environment lives in .venv; a torch that is already importable (a GPU build, say)
# is kept by letting the venv see it, otherwise the CPU build torch==2.13.0 is installed.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	if python3 -c "import torch" 2>/dev/null; then \
		python3 -m venv --system-site-packages $(VENV); else python3 -m venv $(VENV); fi
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/shoal demo

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

clean:
	rm -rf $(VENV)
