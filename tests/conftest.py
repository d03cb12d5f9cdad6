import os

import torch

# Triton reads TRITON_INTERPRET when kernels are defined: set it before grpo_fast.kernels is imported, so that
# impl="triton" runs on this CPU through the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
