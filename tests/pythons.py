"""The interpreters a test may run its subprocess in: this one, and the bare environment (torch, triton and
the oldest supported transformers only: `make test` builds .venv-bare and names it in
GRPO_FAST_BARE_PYTHON)."""

import os
import sys
from pathlib import Path

import pytest


def bare_python() -> str | None:
    bare = os.environ.get("GRPO_FAST_BARE_PYTHON")
    return bare if bare and Path(bare).is_file() else None


def both_pythons() -> list:
    """pytest params: this interpreter ("ours") and the bare one ("bare", skipped where there is none)."""
    no_bare = pytest.mark.skipif(not bare_python(), reason="no bare environment (make test builds it)")
    return [pytest.param(sys.executable, id="ours"), pytest.param(bare_python(), id="bare", marks=no_bare)]
