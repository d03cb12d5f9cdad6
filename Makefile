# grpo-fast: `make demo` (the main job) and `make test` work on a fresh clone.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench bench-full lint clean

setup: $(STAMP)

# torch first and pinned: 2.13.0 is a local CPU build here; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

test: setup
	$(VPY) -m ruff check kernels grpo_fast tests bench scripts
	$(VPY) -m pytest tests

demo: setup
	$(VPY) -m grpo_fast.train --output-dir runs/demo --overwrite-output-dir

# about 17 minutes on a 2-core CPU: kernels at one size, two shared-prefix points, end to end vs TRL, report
bench: setup
	$(VPY) -m bench.bench_loss --ns 1024 --repeats 1
	$(VPY) -m bench.bench_logprobs --ns 1024 --repeats 1
	$(VPY) -m bench.bench_prefix --points 512:64:8,2048:64:8 --repeats 1
	$(VPY) -m bench.bench_e2e
	$(VPY) -m bench.report

# the whole grids (an hour or more on a CPU)
bench-full: setup
	$(VPY) -m bench.bench_loss
	$(VPY) -m bench.bench_logprobs
	$(VPY) -m bench.bench_prefix --full
	$(VPY) -m bench.bench_e2e --steps 3
	$(VPY) -m bench.report

lint: setup
	$(VPY) -m ruff check kernels grpo_fast tests bench

clean:
	rm -rf $(VENV) build *.egg-info
