VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup serve test bench
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) scripts/install.sh
	touch $@

serve: setup            ## start the server with the built-in model
	$(VENV)/bin/leapfrog serve

test: setup             ## run the test suite (the import layering first)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest tests

bench: setup
	$(VENV)/bin/leapfrog bench
