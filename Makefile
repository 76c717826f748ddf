# secondorder: `make demo` and `make test` are all the set-up a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A plain `torch` requirement can pull a multi-GB CUDA build; ask for the CPU build here.
# Override on a GPU machine, e.g. `make test TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
# On public PyPI, Linux torch wheels bundle CUDA; PyTorch's CPU-only wheels live on their
# own index: `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=

.PHONY: venv demo bench bench-quick bench-cuda gpu-check gpu-wheels test-cuda scaling bench-kfac bench-shampoo bench-peers scaling-shampoo reliability test test-slow lint typecheck format clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,examples]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m secondorder demo

$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	touch $@

bench: $(VENV)/.bench
	$(PY) -m benchmarks.bench --json out/bench/bench.json

bench-quick: $(VENV)/.bench
	$(PY) -m benchmarks.bench --quick --json out/bench/bench_quick.json

# On a machine with an NVIDIA GPU and the CUDA build: `make bench-cuda TORCH_SPEC=torch`.
bench-cuda: $(VENV)/.bench
	$(PY) -m benchmarks.bench --quick --device cuda --no-scaling --out out/bench_cuda --json out/bench_cuda/bench_quick.json
	$(PY) -m benchmarks.profile_cuda > out/bench_cuda/profile.md

# The GPU check in one run (CUDA tests, LM with and without capturable against its peer,
# GPU busy) into benchmarks/RESULTS_CUDA.md, nothing fetched (peers from .whl/ if there).
# No venv is built for it: the machine's python3 holds its CUDA torch.  On the CPU,
# `make gpu-check GPU_CHECK_ARGS=--dry-run` checks the script itself.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# The wheels gpu-check installs there (its machine fetches nothing; carry .whl with the
# tree): torch-levenberg-marquardt and mnist1d from PyPI, kfac-pytorch and
# DistributedShampoo (torch-shampoo) built from the archives in PEERS_DIR, pinned as in
# benchmarks/peers.py.  All py3-none-any; their Requires-Dist (torch, lightning, numpy,
# scipy, matplotlib, requests) are on the GPU machine already, so nothing else is needed.
PEERS_DIR ?= $(firstword $(wildcard ../shared/peers ../../shared/peers) ../shared/peers)
PEER_ARCHIVES := kfac-pytorch-869cf11 optimizers-f606606
WHL := .whl
gpu-wheels: venv
	rm -rf $(WHL) $(WHL).build && mkdir -p $(WHL)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(WHL) \
		torch-levenberg-marquardt==1.2.3 mnist1d==0.0.2.post1
	for a in $(PEER_ARCHIVES); do \
		mkdir -p $(WHL).build/$$a && tar -xzf $(PEERS_DIR)/$$a.tar.gz -C $(WHL).build/$$a && \
		$(PY) -m pip wheel -q --no-deps --ignore-requires-python -w $(WHL) $(WHL).build/$$a/src \
		|| exit 1; \
	done
	rm -rf $(WHL).build
	ls $(WHL)

scaling: venv
	$(PY) -m benchmarks.scaling

bench-kfac: $(VENV)/.bench
	$(PY) -m benchmarks.bench --quick --family kfac --threads 1 --out out/kfac --json out/kfac/bench_quick.json

bench-shampoo: $(VENV)/.bench
	$(PY) -m benchmarks.shampoo_bench --quick --json out/shampoo/bench_quick.json

# kfac-pytorch and DistributedShampoo (not on PyPI) beside secondorder in out/peers/venv:
# from PEERS_DIR (archives or source trees; default ../shared/peers when present), else
# from their git repositories at pinned commits. See benchmarks/PEERS.md.
bench-peers: venv
	$(PY) -m benchmarks.peers --torch-spec "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--torch-index $(TORCH_INDEX)) $(if $(PEERS_DIR),--peers-dir $(PEERS_DIR))

scaling-shampoo: venv
	$(PY) -m benchmarks.shampoo_scaling

reliability: venv
	$(PY) -m benchmarks.reliability

lint: venv
	$(PY) -m ruff check secondorder tests examples benchmarks
	$(PY) -m ruff format --check secondorder tests examples benchmarks

typecheck: venv
	$(PY) -m mypy

test: lint typecheck
	$(PY) -m pytest -q -m "not slow"

# The tests marked cuda (skipped where torch sees no GPU): `make test-cuda TORCH_SPEC=torch`.
test-cuda: venv
	$(PY) -m pytest -q -m cuda -rs

test-slow: venv
	$(PY) -m pytest -q -m slow

format: venv
	$(PY) -m ruff format secondorder tests examples benchmarks
	$(PY) -m ruff check --fix secondorder tests examples benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache out
