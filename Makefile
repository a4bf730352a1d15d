# All set-up happens in tools/setup_env.sh (idempotent: a second run takes seconds).
PY := .venv/bin/python

.PHONY: setup digits test test-full test-unit bench bench-compression bench-async bench-hosts bench-balance bench-zero1 \
	bench-overlap bench-overlap-shared bench-compressor-speed bench-loopback-presets bench-auto-hosts
setup:
	bash tools/setup_env.sh

digits: setup
	.venv/bin/tfdp run -np 2 examples/digits.py

# Quick tier (what CI runs): every public feature at least once, real 2-worker jobs included.
test: setup
	$(PY) -m pytest -q -m "not full" --durations=15

# Full tier: the quick tier plus convergence, elastic, emulated hosts (root), benchmarks as tests.
test-full: setup
	$(PY) -m pytest -q --durations=25

# In-process tests only (fake ranks, no horovodrun): about a minute.
test-unit: setup
	$(PY) -m pytest -q -m "not multiprocess"

bench: setup
	$(PY) benchmarks/sync_vs_horovod_vs_mwms.py

bench-compression: setup
	$(PY) benchmarks/compression.py

bench-async: setup
	$(PY) benchmarks/asynchronous.py

# Emulated hosts need root. Three side-by-side runs, results in benchmarks/results/.
RESULTS := benchmarks/results
bench-hosts: setup
	.venv/bin/tfdp bench --presets sync topk-1pct powersgd-r4 async-s1 --rate-mbit 100 \
		--params 6e6 --batch-size 16 --steps 8 --out $(RESULTS)/hosts-100mbit-6M
	.venv/bin/tfdp bench --presets sync async-s1 local-sgd-h16 --rate-mbit 100 \
		--params 1e6 --batch-size 3584 --steps 32 --out $(RESULTS)/hosts-100mbit-balanced
	.venv/bin/tfdp bench --presets sync fp16 --workload cnn --batch-size 64 --steps 10 \
		--out $(RESULTS)/loopback-cnn
	.venv/bin/tfdp bench --presets sync fp16 topk-1pct async-s1 --workload digits --rate-mbit 100 \
		--epochs 15 --target-accuracy 0.95 --out $(RESULTS)/hosts-100mbit-digits

# Optimizer-state sharding: zero1 against sync with Adam on loopback (the make-bench MLP size,
# then 6 M parameters on 4 workers for memory), then link bytes on 2 emulated hosts (root).
bench-zero1: setup
	.venv/bin/tfdp bench --presets sync zero1 --workload mlp --params 670000 --batch-size 32 --optimizer adam \
		--steps 60 --warmup-steps 10 --out $(RESULTS)/loopback-zero1
	.venv/bin/tfdp bench --presets sync zero1 -np 4 --workload mlp --params 6e6 --batch-size 16 --optimizer adam \
		--steps 16 --out $(RESULTS)/loopback-zero1-4workers-6M
	.venv/bin/tfdp bench --presets sync zero1 --rate-mbit 100 --workload mlp --params 1e6 --batch-size 32 \
		--optimizer adam --steps 12 --out $(RESULTS)/hosts-100mbit-zero1

# Heterogeneous workers (root): rank 1 under a CPU quota of half a CPU, balanced against sync,
# then the same without a slow worker, then 4 workers (4 processes share 2 cores, half a CPU
# each, so rank 1 gets a quarter CPU: about 2x slower than the others).
bench-balance: setup
	.venv/bin/tfdp bench --presets sync balanced --workload cnn --batch-size 64 --rate-mbit 1000 \
		--steps 40 --warmup-steps 60 --slowdown 1:2 --out $(RESULTS)/hosts-balanced-slow1x2
	.venv/bin/tfdp bench --presets sync balanced --workload cnn --batch-size 64 --rate-mbit 1000 \
		--steps 40 --warmup-steps 60 --out $(RESULTS)/hosts-balanced-noslow
	.venv/bin/tfdp bench --presets sync balanced -np 4 --workload cnn --batch-size 64 --rate-mbit 1000 \
		--steps 40 --warmup-steps 60 --slowdown 1:4 --out $(RESULTS)/hosts-balanced-4workers-slow1x2

# Overlap (root): sync in one group (bucket_bytes=null), in its default 256 KiB buckets and in 1 MiB
# buckets on the CNN, on 2 emulated hosts of one CPU each (--pin-cpus) at 100, 200 and 400 Mbit/s; the
# advisor column is the no-overlap prediction C + M. bench-overlap-shared: the same without --pin-cpus.
OVERLAP := sync:bucket_bytes=null sync sync:bucket_bytes=1048576
bench-overlap: setup
	for rate in 100 200 400; do .venv/bin/tfdp bench --presets $(OVERLAP) --workload cnn --batch-size 64 \
		--rate-mbit $$rate --steps 30 --pin-cpus --out $(RESULTS)/hosts-$${rate}mbit-cnn-buckets-pinned || exit 1; done
bench-overlap-shared: setup
	for rate in 100 400; do .venv/bin/tfdp bench --presets $(OVERLAP) --workload cnn --batch-size 64 \
		--rate-mbit $$rate --steps 30 --out $(RESULTS)/hosts-$${rate}mbit-cnn-buckets || exit 1; done
	.venv/bin/tfdp bench --presets $(OVERLAP) --workload cnn --batch-size 64 \
		--steps 20 --out $(RESULTS)/loopback-cnn-buckets

# Each compressed preset's compute per step on the 6 M-parameter MLP's gradients (one thread).
bench-compressor-speed: setup
	$(PY) benchmarks/compressor_speed.py

# The compressed presets against sync on loopback, the digits conv net, alternating in the same processes.
bench-loopback-presets: setup
	$(PY) benchmarks/paired_presets.py

# auto against the presets it picks among (root): the CNN and the 6 M-parameter MLP on 2 emulated hosts at
# 100 and 1000 Mbit/s, every preset in the same processes in alternating blocks.
AUTO_PRESETS := sync topk-1pct powersgd-r4 auto
bench-auto-hosts: setup
	for rate in 100 1000; do \
		$(PY) benchmarks/paired_presets.py --presets $(AUTO_PRESETS) --workload cnn --batch-size 64 --steps 20 \
			--blocks 15 --rate-mbit $$rate --json $(RESULTS)/paired-hosts-$${rate}mbit-cnn.json || exit 1; \
		$(PY) benchmarks/paired_presets.py --presets $(AUTO_PRESETS) --workload mlp --params 6e6 --batch-size 16 \
			--steps 8 --blocks 9 --rate-mbit $$rate --json $(RESULTS)/paired-hosts-$${rate}mbit-6M.json || exit 1; \
	done
