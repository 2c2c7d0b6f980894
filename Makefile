PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Dev and CI pin the CPU build of torch; users installing the package get an unpinned torch.
CONSTRAINTS := constraints.txt
# where the pinned "+cpu" torch comes from when pip's own sources (PyPI, a local wheel house) do not have it
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

NOT_COMPILED := /tests?/|/transformers/models/(?!auto/)[^/]+/
# the package's own code (the batchgen namespace is the repository root, its subpackages the folders holding an
# __init__.py) and the benches tests import
CODE := __init__.py $(dir $(wildcard */__init__.py)) bench

.PHONY: venv bytecode run test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	@# a second index only where needed: an index pip cannot reach costs its retries on every package
	index=$$($(VENV)/bin/pip install -q --dry-run --no-deps --ignore-installed "$$(grep '^torch==' $(CONSTRAINTS))" \
		> /dev/null 2>&1 || echo "--extra-index-url $(TORCH_INDEX)"); \
	$(VENV)/bin/pip install -q --no-compile -c $(CONSTRAINTS) $$index -e '.[dev]'
	@# the bytecode pip would compile on one core, on every core (about half the time: the longest part of the
	@# install); a file only a newer Python parses fails here, as it does silently under pip. Left out: packages'
	@# own test folders and transformers' model folders but `auto` (~5,000 of ~22,000 files, a quarter of this
	@# step), which nothing imports or only the few model families a test compares against
	$(VENV)/bin/python -m compileall -q -j 0 -x '$(NOT_COMPILED)' $(VENV)/lib > /dev/null || true
	touch $(STAMP)

# Where PYTHONDONTWRITEBYTECODE is set (the dev box sets it) no process caches the bytecode it compiles, so each one
# that imports batchgen compiled it again: ~0.4 s of CPU a process, and a job starts an engine actor, read and write
# workers, the test suite ~150 such processes. Compiled here once (only what changed since); the checkout's own
# __pycache__ folders are git-ignored.
bytecode: $(STAMP)
	$(VENV)/bin/python -m compileall -q -j 0 $(CODE) > /dev/null

run: bytecode
	$(VENV)/bin/batchgen demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# two pytest workers: most tests wait on Ray actor and subprocess start-up, so two overlap well on 2 cores; tests go
# out one at a time, longest first (tests/conftest.py), to whichever worker is free: in chunks, one worker got every
# long test and ran 160 s alone at the end
test: lint bytecode
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist load --maxschedchunk 1

bench: $(STAMP)
	$(VENV)/bin/python bench/bct.py --quick

clean:
	rm -rf $(VENV) out build *.egg-info
