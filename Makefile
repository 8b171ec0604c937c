# Two commands for a new machine: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autoshard-installed

.PHONY: demo test lint venv bench clean spt-check gpu-check gpu-check-smoke image-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,deepspeed]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m autoshard.demo

# The CPU suite, as CI runs it: a GPU of this machine is hidden (CUDA_VISIBLE_DEVICES=), so a budget keeps no CUDA
# headroom and DeepSpeed takes its CPU accelerator here too. The GPU tests run with `make gpu-check`.
test: lint
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q

# ruff (lint + format) and the layers contract in pyproject.toml: an upward import or an import circle fails here.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/lint-imports

# Opt-in: autoshard under real stable-pretraining 0.1.8 code (docs/guide.md). Installs it, and the part of its
# dependencies that it imports, into $(SPT_SITE) without --deps: the venv's torch stays as it is.
SPT_SITE ?= .spt-site
SPT_PACKAGES := stable-pretraining==0.1.8 torchvision==0.28.0 timm kornia kornia_rs torchmetrics lightning-utilities \
	loguru omegaconf antlr4-python3-runtime==4.9.3 hydra-core tabulate rich markdown-it-py mdurl pygments prettytable \
	wcwidth pillow datasets multiprocess dill xxhash pyarrow pandas python-dateutil pytz tzdata six requests urllib3 \
	certifi requests_cache url_normalize cattrs matplotlib pyparsing cycler kiwisolver fonttools

spt-check: $(STAMP)
	test -d $(SPT_SITE) || $(PY) -m pip install -q --no-deps --target $(SPT_SITE) $(SPT_PACKAGES)
	PYTHONPATH=$(abspath $(SPT_SITE)) $(PY) -m pytest -q -p no:cacheprovider tests/integration/test_stable_pretraining.py

# The GPU evidence in one time-boxed command (about 6 minutes on one GPU): every `gpu` test in one pytest process, then
# the benchmark configurations (benchmarks/gpu_check.py says which), results and a table under $(GPU_OUT). Runs with
# whatever Python has torch with CUDA (GPU_PY=python3 on a machine with no venv); DeepSpeed rows need deepspeed.
GPU_PY ?= $(PY)
GPU_OUT ?= gpu-check-out

gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) benchmarks/gpu_check.py --out $(GPU_OUT)

# The same script on CPU with a tiny model (about 90 s): every configuration (the --only extras too), table and JSON
# exercised, nothing measured. Run it before a GPU session, so the device's minutes are not spent on a broken script.
gpu-check-smoke: $(STAMP)
	PYTHONPATH=src $(SMOKE_PY) benchmarks/gpu_check.py --out gpu-check-smoke --smoke --skip-tests --deadline 900
SMOKE_PY ?= $(PY)

# Opt-in, about 3 GB and 40 minutes: the CPU suite and the smoke run of the GPU script under the GPU image's torch
# (2.11; its CUDA wheel runs on a CPU), in $(IMAGE_VENV). Run it before a GPU session: what differs on that torch is
# found here, not in the device's 15 minutes (session 11 found three: docs/benchmarks.md).
IMAGE_VENV ?= .venv-image
IMAGE_TORCH ?= torch==2.11.0
image-check:
	test -x $(IMAGE_VENV)/bin/python || $(PYTHON) -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/pip install -q "$(IMAGE_TORCH)"
	$(IMAGE_VENV)/bin/pip install -q -e ".[test,deepspeed]"
	CUDA_VISIBLE_DEVICES= $(IMAGE_VENV)/bin/python -m pytest -q -p no:cacheprovider
	$(MAKE) gpu-check-smoke SMOKE_PY=$(abspath $(IMAGE_VENV))/bin/python

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
