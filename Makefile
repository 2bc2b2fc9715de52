# Two entry points: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build; the package itself only asks for torch>=2.6.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	# The layering contracts of pyproject.toml (docs/architecture.md): an import that breaks one,
	# or closes a cycle, fails here before any test runs.
	$(VENV)/bin/lint-imports --no-cache
	# Two pytest-xdist workers: the tests/dist jobs one after another in one, the
	# single-process tests beside them in the other (tests/conftest.py). A short --basetemp:
	# error messages shorten long paths, and xdist's folders (.../pytest-N/popen-gw1/) are
	# longer than pytest's own.
	$(PY) -m pytest tests -n 2 --basetemp=/tmp/apt-$$$$; status=$$?; rm -rf /tmp/apt-$$$$; exit $$status

clean:
	rm -rf $(VENV) build *.egg-info
