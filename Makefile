# Set-up, tests (ruff, the import-linter layer contracts of pyproject.toml, pytest) and the main job.
# Every target creates .venv first if it is missing.
VENV ?= .venv
PLATFORM ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-$(PLATFORM)
# The environment every test run gets, here and in CI (.ci/run is `make test` with CI=true added). The two
# workers' engines bind their OpenMP threads to the same cores: threads that wait passively leave the core to the
# other engine instead of spinning on it (about 7% less CPU time on the engine tests; answers do not depend on it).
TEST_ENV := PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false OMP_WAIT_POLICY=PASSIVE
# Two pytest-xdist workers (the CI machine has two cores; most of the suite's time is spent in engines and
# servers that start single-threaded); `make test PYTEST_WORKERS=` runs in one process.
PYTEST_WORKERS ?= -n 2 --no-loadscope-reorder
# mypy (~30 s of one core from an empty cache) runs alongside pytest at the lowest priority, in the moments the
# workers leave a core idle (servers starting, clients waiting); its report follows pytest's, and either failing
# fails the target.

.PHONY: setup test device-check mutation fuzz demo lint docs clean

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml scripts/setup_env.sh scripts/vllm_requirements.py \
		$(wildcard csrc/*.h csrc/cpu/* csrc/ascend/*)
	PLATFORM=$(PLATFORM) bash scripts/setup_env.sh $(VENV)

test: setup
	bash scripts/test_services.sh
	$(PY) -m ruff check lmcache_platforms lmcache_platforms_npu_device.py tests scripts
	$(VENV)/bin/lint-imports --no-cache
	nice -n 19 $(PY) -m mypy > $(VENV)/mypy.log 2>&1 & typing=$$!; \
	$(TEST_ENV) $(PY) -m pytest -q $(PYTEST_WORKERS) --durations=15; tests=$$?; \
	wait $$typing; typed=$$?; cat $(VENV)/mypy.log; [ $$tests = 0 ] && [ $$typed = 0 ]

# On a GPU machine (make device-check PLATFORM=cuda): the kernel contract suite, the Triton kernel run on the GPU
# and its bench against a same-size copy, as one JSON object on stdout (DEVICE_CHECK_ARGS="--runs 3": each bench
# three times, with each figure's range).
device-check: setup
	$(TEST_ENV) $(PY) scripts/device_check.py $(DEVICE_CHECK_ARGS)

# The differential fuzzer (not in CI): random settings and workloads, every answer against a reference that stored
# nothing, blocks poisoned before each load (tests/fuzz/run.py). FUZZ_ARGS="--requests 2000" or "--minutes 60";
# a failure prints its seed and a one-line replay command; tests/fuzz/test_fuzz_slice.py is its slice in CI.
FUZZ_ARGS ?= --minutes 10
fuzz: setup
	$(TEST_ENV) $(PY) -m tests.fuzz.run $(FUZZ_ARGS)

# Mutation testing (not in CI; minutes): mutmut mutates the modules pyproject.toml's [tool.mutmut] names and runs
# the tests covering each mutant; docs/mutation.md holds the last score and why each survivor is equivalent.
MUTMUT := mutmut==3.8.1
mutation: setup
	$(PY) -m pip install -q $(MUTMUT)
	rm -rf mutants
	$(TEST_ENV) OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 2; status=$$?; $(VENV)/bin/mutmut results; exit $$status

demo: setup
	$(VENV)/bin/lmcache-platforms demo

# The generated docs: benchmark tables from docs/bench/*.json, the configuration reference from the settings'
# declarations, the patch files from the catalog (tests fail when a committed copy differs from its generator's).
docs: setup
	$(PY) scripts/bench_docs.py
	$(PY) scripts/config_docs.py
	$(PY) -m scripts.make_patches

lint: setup
	$(PY) -m ruff check lmcache_platforms lmcache_platforms_npu_device.py tests scripts
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) build *.egg-info lmcache_platforms/kernels/*.so mutants
