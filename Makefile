# The two commands of the README. Each installs what it needs into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels

.PHONY: run test torchrec kernels clean FORCE

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# The test suite also exercises the TorchRec interop and the prediction server, so it installs those extras.
$(VENV)/.torchrec: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,serve,torchrec]'
	$(BIN)/pip install --quiet --no-deps torchrec==1.8.0
	touch $(VENV)/.torchrec

# The fused C++ CPU kernels (embedding/kernels.cpp: training; embedding/quant_kernels.cpp: the quantized
# serving lookup), compiled once here into
# .venv/var/embedscale-kernels, never during training or tests (without a build the PyTorch path runs).
# The build step runs every time (a second or two when done: builds are named by a hash of their source and
# flags), so a stale timestamp can never leave a changed kernel unbuilt.
$(KERNELS): $(STAMP) FORCE
	$(BIN)/python -m embedscale.embedding.kernels --build || echo "warning: fused CPU kernel not built; the PyTorch path is used"
	touch $(KERNELS)

FORCE:

run: $(STAMP) $(KERNELS)
	$(BIN)/embedscale run

# Two pytest workers (pytest-xdist), a test file each at a time: on 2 cores a single-process test leaves the
# other core idle, and the multi-rank tests are built to pass under load (1.55x faster, 543 s against 843 s).
test: $(VENV)/.torchrec $(KERNELS)
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# Optional: TorchRec as baseline and interop partner (its own deps pull a GPU fbgemm, hence --no-deps).
torchrec: $(VENV)/.torchrec

kernels: $(KERNELS)

clean:
	rm -rf $(VENV) runs
