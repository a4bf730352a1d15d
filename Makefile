# All set-up happens in tools/setup_env.sh (idempotent: a second run takes seconds).
PY := .venv/bin/python

.PHONY: setup digits test test-fast bench bench-compression bench-async
setup:
	bash tools/setup_env.sh

digits: setup
	.venv/bin/tfdp run -np 2 examples/digits.py

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not multiprocess"

bench: setup
	$(PY) benchmarks/sync_vs_horovod_vs_mwms.py

bench-compression: setup
	$(PY) benchmarks/compression.py

bench-async: setup
	$(PY) benchmarks/asynchronous.py
