# Every install path holds torch to the local CPU build (constraints.txt): an unpinned torch
# pulls several GB of CUDA wheels.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TINY := .cache/tiny/llama-s0
SMALL := .cache/small/llama-s0

.PHONY: install demo test lint bench bench-engine clean

$(BIN)/orbit: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(BIN)/orbit

install: $(BIN)/orbit

$(TINY)/model.safetensors: | $(BIN)/orbit
	$(BIN)/orbit model tiny $(TINY) --arch llama --seed 0

demo: install $(TINY)/model.safetensors
	rm -rf runs/tiny
	$(BIN)/orbit train recipes/tiny.yaml --mode double-buffer

test: install
	$(BIN)/ruff check orbit tests bench
	$(BIN)/pytest -q

$(SMALL)/model.safetensors: | $(BIN)/orbit
	$(BIN)/orbit model tiny $(SMALL) --arch llama --seed 0 --size small

bench: install $(SMALL)/model.safetensors
	$(BIN)/orbit bench bench/five-panel.yaml --steps 8 --warmup 2 --out runs/bench

bench-engine: install
	$(BIN)/python bench/engine_throughput.py

clean:
	rm -rf $(VENV) .cache runs
