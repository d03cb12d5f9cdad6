import os

import torch

# Triton reads TRITON_INTERPRET when kernels are defined: set it before grpo_fast.kernels is imported, so that
# impl="triton" runs on this CPU through the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# --bf16 unset means fp32 on every CPU under test (the measured table turns it on where bf16 is faster, which
# differs between the machines CI lands on); subprocesses inherit it; test_precision checks the table itself
os.environ.setdefault("GRPO_FAST_CPU_BF16", "0")

# Inductor's cache keys miss ATen's CPU capability: a graph compiled under ATEN_CPU_CAPABILITY=avx512 and
# reused under =avx2 on the same machine segfaulted (tests/test_rollout.py's compiled decode); one cache per
# capability (subprocesses inherit it)
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"torchinductor_{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}"
    ),
)

import pytest  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct (built offline by grpo_fast.tasks.smollm2) and its tokenizer, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    from grpo_fast.tasks.smollm2 import build
    from grpo_fast.trainer.modeling import load_tokenizer

    path = build()
    tok = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    # on a GPU machine the kernels compile for CUDA; CPU tensors with impl="triton" need the interpreter
    no_interp = pytest.mark.skip(
        reason="impl='triton' on CPU tensors needs TRITON_INTERPRET=1 (set it to include)"
    )
    for item in items:
        if "requires_cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("impl") == "triton" and not INTERPRET and "requires_cuda" not in item.keywords:
            item.add_marker(no_interp)
