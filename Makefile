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

.PHONY: install protos demo test test-deps test-chaos test-browser test-loaded test-restart-loop lint \
	bench-train bench-fsdp bench-memory bench-replay bench-apex bench-recovery bench-wan bench-sampling \
	bench-data bench-learner bench-deps clean image image-base image-check image-deps deploy-check example-data

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
test: install deploy-check test-deps
	$(PY) -m pytest -q -m "not chaos"

# Programs the tests run as real peers: Debian's prometheus (and its promtool) for the
# dashboard test (tests/integration/test_grafana_prometheus.py) and `promtool check metrics`.
# Installed when missing (needs root, as in CI); without it those tests skip, or fail in CI.
test-deps:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	if [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends prometheus; \
	else echo "test-deps: prometheus missing; run as root or: sudo apt-get install prometheus"; fi

# Real daemon processes killed with signals (tests/chaos); CI runs it after `make test`.
test-chaos: install
	$(PY) -m pytest -q -m chaos tests/chaos

# Under load (issue 20): the failover, partition, durability, decay-once, resume, forget and
# invariant tests RUNS times under BURNERS busy processes, each run's output and daemon logs
# kept (tests/loaded.py prints where); and the full-restart chaos test in a loop, tallying
# whether the first dump after the status said RF 2 had equal copies. Not part of `make test`.
RUNS ?= 10
BURNERS ?= 2
test-loaded: install
	$(PY) -m tests.loaded loaded --runs $(RUNS) --burners $(BURNERS)

test-restart-loop: install
	$(PY) -m tests.loaded restart --runs $(RUNS) --burners $(BURNERS)

# The dashboard in a real browser: Playwright (the dev extra) driving Debian's chromium, which
# is installed here when missing (Playwright cannot download its own). CI runs it after `make test`.
test-browser: install
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	$(PY) -m pytest -q -m browser tests/browser

lint: install
	$(VENV)/bin/ruff format --check coordinator worker shared examples tests deploy
	$(VENV)/bin/ruff check coordinator worker shared examples tests deploy
	$(VENV)/bin/mypy coordinator worker shared examples
	$(VENV)/bin/lint-imports

# Container image (CPU torch) with docker where its daemon runs, else buildah
# (deploy/docker/build.sh; ENGINE=docker|buildah chooses). Build arguments are passed when set:
# BASE_IMAGE (default python:3.11-slim), TORCH_SPEC, TORCH_INDEX (empty: pip's own config),
# EXTRAS; e.g. the CUDA image: make image IMAGE=neuroshard:gpu
# BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu22.04 TORCH_INDEX=https://download.pytorch.org/whl/cu126 EXTRAS=gpu
# buildah builds mount the host's CA bundle and pip find-links directory read-only (a
# TLS-inspecting proxy): found at make time, CA_BUNDLE= and FIND_LINKS_DIR= override.
IMAGE ?= neuroshard:dev
IMAGE_BASE ?= localhost/neuroshard-base:bookworm
IMAGE_ARGS = TORCH_SPEC=$(TORCH_SPEC) \
	$(foreach v,BASE_IMAGE TORCH_INDEX EXTRAS,$(if $(filter undefined,$(origin $(v))),,$(v)=$($(v))))

# Each image target first installs what it needs (buildah and podman, and mmdebstrap for the
# base) with apt-get when missing and make runs as root, as test-browser does chromium; as
# another user it prints the exact command and stops. DRY_RUN=1 only says what it would
# install: make image-deps DRY_RUN=1
DRY_RUN ?= 0

image-deps:
	DRY_RUN=$(DRY_RUN) deploy/docker/build.sh deps check

image:
	DRY_RUN=$(DRY_RUN) deploy/docker/build.sh deps image
	deploy/docker/build.sh image $(IMAGE) $(IMAGE_ARGS)

# A Debian 12 base image with Python 3.11 from Debian's packages (mmdebstrap, ~1 min), for
# machines that reach no container registry: make image BASE_IMAGE=$(IMAGE_BASE)
image-base:
	DRY_RUN=$(DRY_RUN) deploy/docker/build.sh deps base
	deploy/docker/build.sh base $(IMAGE_BASE)

# Build the image from nothing (image-base, then image from it) and run it: --help, the demo
# (test accuracy >= 0.95), `up --workers 2` with a memory job, as the image's non-root user;
# prints the time of each phase (installing the tools included) and the image size. Installs
# what it needs as image-deps does (the script itself, so that phase is timed); slow (see
# README), not in `make test`.
image-check:
	DRY_RUN=$(DRY_RUN) IMAGE=$(IMAGE) BASE_IMAGE=$(IMAGE_BASE) deploy/docker/image_check.sh

# Render every overlay with kubectl kustomize, validate it offline against the Kubernetes
# schemas and the daemons' CLI/config, fail if a daemon would run without mutual TLS and
# tokens (or with insecure), check ports, secrets and NetworkPolicies, lint the Dockerfile.
deploy-check: $(STAMP)
	$(PY) deploy/check.py

bench-train: install example-data
	$(PY) -m tests.benchmarks.bench_train --gpt-data $(EXAMPLE_DATA)/chars.npz

# The README's example data sets (examples/prepare.py) in EXAMPLE_DATA: chars.npz, the text of
# Debian's fortunes package (fetched with `apt-get download` and `dpkg -x`: no root, nothing
# installed; as root it runs `apt-get update` once when the package lists are missing),
# digits32.npz and diabetes.npz (scikit-learn's bundled data).
EXAMPLE_DATA ?= .neuroshard/examples
example-data: install
	$(PY) -m examples.prepare all --out-dir $(EXAMPLE_DATA)

# Per-rank parameter and optimizer bytes of sharding: fsdp against DDP on a wider MLP.
bench-fsdp: install
	$(PY) -m tests.benchmarks.bench_fsdp

# Debian's redis-server is the baseline the memory benchmarks run beside ours (tests/benchmarks/
# bench_redis.py): installed when missing, so the Redis column is never skipped on a fresh machine.
bench-memory: install bench-deps
	$(PY) -m tests.benchmarks.bench_memory

bench-deps:
	@command -v redis-server >/dev/null || \
	if [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends redis-server; \
	else echo "bench-deps: redis-server missing; run as root or: sudo apt-get install redis-server"; exit 1; fi

# Reverb (dm-reverb 0.14 pins tensorflow 2.15) runs in a virtual environment of its own, made
# here on first use, never in the project's: tests/benchmarks/replay_peer_reverb.py imports
# nothing of ours and prints JSON that bench_replay.py puts beside our figures.
REVERB_VENV ?= .venv-reverb
bench-replay: install
	test -x $(REVERB_VENV)/bin/python || $(PYTHON) -m venv $(REVERB_VENV)
	test -f $(REVERB_VENV)/.installed || ($(REVERB_VENV)/bin/pip install -q "dm-reverb==0.14.0" \
		"tensorflow~=2.15.0" && touch $(REVERB_VENV)/.installed)
	$(PY) -m tests.benchmarks.bench_replay --reverb-python $(REVERB_VENV)/bin/python

# Ape-X on CartPole-v1 through a replay table: prioritized vs uniform, 5 seeds, and runs with a
# worker killed (about an hour on 2 cores); writes docs/apex-cartpole.png.
bench-apex: install
	$(PY) -m tests.benchmarks.bench_apex

bench-recovery: install
	$(PY) -m tests.benchmarks.bench_recovery

# A data set 1.6x a worker's memory limit (a cgroup per worker when one can be made, else the
# limit is only stated) trains on 2 workers; prints each process's peak RSS (VmHWM).
bench-data: install
	$(PY) -m tests.benchmarks.bench_data

# Training over emulated WAN links (configs/links-wan.yaml): naive sync, network-aware sync
# and diloco side by side; then bytes per step of each compression on a 1.86M-parameter MLP.
bench-wan: install
	$(PY) -m tests.benchmarks.bench_wan

# Prioritized sampling and priority updates, batches of 256 with 1 KiB payloads, on a local
# 3-worker cluster of 100k memories: p50/p99 per call, samples/s, updates/s.
bench-sampling: install
	$(PY) -m tests.benchmarks.bench_sampling

# The seed roadmap's three validations of the memory store: 10M memories x 20 iterations (a
# memory job), 5 workers x 100k memories x 50 iterations against the reference, and the same
# with a worker killed (SIGKILL) at iteration 25. --quick: all three small, in-process.
bench-learner: install example-data
	$(PY) -m tests.benchmarks.bench_learner --gpt-data $(EXAMPLE_DATA)/chars.npz

clean:
	rm -rf $(VENV) shared/proto/*_pb2*.py shared/proto/*_pb2*.pyi .pytest_cache .mypy_cache .ruff_cache
