# The two commands of the README. Each installs what it needs into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test torchrec clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# The test suite also exercises the TorchRec interop, so it installs the optional extra.
$(VENV)/.torchrec: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,torchrec]'
	$(BIN)/pip install --quiet --no-deps torchrec==1.8.0
	touch $(VENV)/.torchrec

run: $(STAMP)
	$(BIN)/embedscale run

test: $(VENV)/.torchrec
	$(BIN)/pytest -q tests

# Optional: TorchRec as baseline and interop partner (its own deps pull a GPU fbgemm, hence --no-deps).
torchrec: $(VENV)/.torchrec

clean:
	rm -rf $(VENV) runs
