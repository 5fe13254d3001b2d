# Every install path holds torch to the local CPU build (constraints.txt): an unpinned torch
# pulls several GB of CUDA wheels.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TINY := .cache/tiny/llama-s0
SMALL := .cache/small/llama-s0

# SGLang (engine.backend: sglang) goes into the same venv. On a CPU-only machine the script installs
# sglang 0.5.23 with --no-deps plus the CPU-usable part of its requirements (no CUDA wheels) and
# Orbit's CPU shims; where `nvidia-smi -L` works it runs a normal `pip install sglang==0.5.23`.
SGLANG := $(VENV)/.orbit-sglang-stamp
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: install sglang demo test lint bench bench-engine bench-sglang clean

$(BIN)/orbit: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(BIN)/orbit

install: $(BIN)/orbit

$(SGLANG): scripts/install_sglang.sh requirements/sglang-cpu.txt constraints.txt \
		orbit/engine/sglang_cpu/pypath/orbit_sglang_cpu_shims.py | $(BIN)/orbit
	bash scripts/install_sglang.sh $(VENV)
ifeq ($(HAS_GPU),yes)
	# sglang 0.5.23 brings torch 2.14.1 on GPU; Orbit's own torch==2.13.0 pin must not undo that
	$(BIN)/pip install -q --no-deps -e '.[dev]'
else
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
endif
	touch $(SGLANG)

sglang: $(SGLANG)

$(TINY)/model.safetensors: | $(BIN)/orbit
	$(BIN)/orbit model tiny $(TINY) --arch llama --seed 0

demo: install $(TINY)/model.safetensors
	rm -rf runs/tiny
	$(BIN)/orbit train recipes/tiny.yaml --mode double-buffer

test: install sglang
	$(BIN)/ruff check orbit tests bench scripts
	$(BIN)/pytest -q

$(SMALL)/model.safetensors: | $(BIN)/orbit
	$(BIN)/orbit model tiny $(SMALL) --arch llama --seed 0 --size small

bench: install $(SMALL)/model.safetensors
	$(BIN)/orbit bench bench/five-panel.yaml --steps 8 --warmup 2 --out runs/bench

bench-engine: install
	$(BIN)/python bench/engine_throughput.py

bench-sglang: install sglang
	$(BIN)/python bench/sglang_vs_embedded.py

clean:
	rm -rf $(VENV) .cache runs
