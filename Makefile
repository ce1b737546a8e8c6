# neuroshard: `make demo` and `make test` do all set-up on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel by default; override for a CUDA build, e.g. make install TORCH_SPEC=torch==2.13.0+cu124
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/shared/proto/*.proto)
PROTO_OUT := $(patsubst protos/%.proto,%_pb2.py,$(PROTO_SRC))
# Type stubs of the generated code by mypy-protobuf (messages, and the services for grpc.aio
# only: every stub and servicer of the code base is async), checked by mypy --strict.
PROTOC = $(PY) -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. \
	--plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy --mypy_out=. \
	--plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc --mypy_grpc_out=only_async:.

.PHONY: install protos demo test test-chaos test-browser lint bench-train bench-memory bench-recovery bench-wan clean \
	image deploy-check

install: $(STAMP) $(PROTO_OUT)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Generated gRPC code (never edited by hand, not committed): protos/shared/proto/x.proto -> shared/proto/x_pb2.py
$(PROTO_OUT) &: $(PROTO_SRC) $(STAMP)
	$(PROTOC) $(PROTO_SRC)

protos: $(STAMP)
	$(PROTOC) $(PROTO_SRC)

demo: install
	$(VENV)/bin/neuroshard demo

# Unit and integration tests (and the deployment check); the chaos tests run separately.
test: install deploy-check
	$(PY) -m pytest -q -m "not chaos"

# Real daemon processes killed with signals (tests/chaos); CI runs it after `make test`.
test-chaos: install
	$(PY) -m pytest -q -m chaos tests/chaos

# The dashboard in a real browser: Playwright (the dev extra) driving Debian's chromium, which
# is installed here when missing (Playwright cannot download its own). CI runs it after `make test`.
test-browser: install
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	$(PY) -m pytest -q -m browser tests/browser

lint: install
	$(VENV)/bin/ruff format --check coordinator worker shared tests deploy
	$(VENV)/bin/ruff check coordinator worker shared tests deploy
	$(VENV)/bin/mypy coordinator worker shared
	$(VENV)/bin/lint-imports

# Container image (CPU torch); see deploy/docker/Dockerfile for the CUDA build arguments.
image:
	docker build -f deploy/docker/Dockerfile -t neuroshard:dev .

# Render every overlay with kubectl kustomize, validate it offline against the Kubernetes
# schemas and the daemons' CLI/config, fail if a daemon would run without mutual TLS and
# tokens (or with insecure), check ports, secrets and NetworkPolicies, lint the Dockerfile.
deploy-check: $(STAMP)
	$(PY) deploy/check.py

bench-train: install
	$(PY) -m tests.benchmarks.bench_train

bench-memory: install
	$(PY) -m tests.benchmarks.bench_memory

bench-recovery: install
	$(PY) -m tests.benchmarks.bench_recovery

# Training over emulated WAN links (configs/links-wan.yaml): naive sync, network-aware sync
# and diloco side by side; then bytes per step of each compression on a 1.86M-parameter MLP.
bench-wan: install
	$(PY) -m tests.benchmarks.bench_wan

clean:
	rm -rf $(VENV) shared/proto/*_pb2*.py shared/proto/*_pb2*.pyi .pytest_cache .mypy_cache .ruff_cache
